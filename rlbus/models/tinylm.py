"""The reference model: a small causal transformer with rotary positions and a KV-cache pool.

Random init from a seed (so every worker starts bit-identical), size set by flags.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
import torch
import torch.nn.functional as F
from torch import nn


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    vocab_size: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 128
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter (and KV cache) dtype. bfloat16 is initialised in float32 from the seed and
    rounded, so a float32 master copy of the same seed rounds to the same weights."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Rotary(nn.Module):
    """Rotary embedding. cos/sin tables are derived state, rebuilt from `inv_freq`."""

    def __init__(self, head_dim: int, max_seq_len: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq)
        self.max_seq_len = max_seq_len
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def rebuild(self) -> None:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]  # a registered buffer
        t = torch.arange(self.max_seq_len, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        self._cos, self._sin = freqs.cos(), freqs.sin()

    def drop_tables(self) -> None:
        self._cos = self._sin = None

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        # x: [H, T, Dh]
        if self._cos is None:
            self.rebuild()
        assert self._cos is not None and self._sin is not None
        t = x.shape[-2]
        cos = self._cos[start : start + t].to(x.dtype)
        sin = self._sin[start : start + t].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(
        self, x: torch.Tensor, rotary: Rotary, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, start: int
    ) -> torch.Tensor:
        # x: [T, D]; caches: [H, max_len, Dh] for this slot and layer (or None: no cache)
        cfg = self.cfg
        t = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).split(cfg.d_model, dim=-1)
        q, k, v = (z.view(t, cfg.n_heads, cfg.head_dim).transpose(0, 1) for z in (q, k, v))
        q, k = rotary(q, start), rotary(k, start)
        if k_cache is not None and v_cache is not None:
            k_cache[:, start : start + t] = k
            v_cache[:, start : start + t] = v
            k_all, v_all = k_cache[:, : start + t], v_cache[:, : start + t]
        else:
            if start != 0:
                raise ValueError("a forward without a cache must start at position 0")
            k_all, v_all = k, v
        total = start + t
        # query i (absolute position start+i) sees keys 0..start+i
        mask = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(diagonal=start)
        att = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        x = x + self.proj(att.transpose(0, 1).reshape(t, cfg.d_model))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x


def _cast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Its parameters (only: the rotary tables stay float32) to `dtype`, initialised as float32."""
    for p in module.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return module


class TinyLM(nn.Module):
    """A causal LM small enough for CPUs, real enough to train and to serve."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)
        try:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            # each block takes its dtype as it is built: a bf16 model never holds a float32 copy of itself
            self.blocks = nn.ModuleList(_cast(Block(cfg), cfg.torch_dtype) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            nn.init.normal_(self.lm_head.weight, std=1.0 / math.sqrt(cfg.d_model))
        finally:
            torch.random.set_rng_state(gen_state)
        _cast(self, cfg.torch_dtype)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len)

    def forward(self, tokens: torch.Tensor, kv: KVCache | None = None, slot: int = 0, start: int = 0) -> torch.Tensor:
        """tokens: [T] -> logits [T, vocab]. With a cache, positions start..start+T-1 are written."""
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            kc = kv.k[i, slot] if kv is not None else None
            vc = kv.v[i, slot] if kv is not None else None
            x = block(x, self.rotary, kc, vc, start)
        return self.lm_head(self.ln_f(x))


class KVCache:
    """A preallocated pool of per-request cache slots, like an inference engine's KV memory."""

    def __init__(self, cfg: ModelConfig, slots: int, dtype: torch.dtype = torch.float32) -> None:
        self.cfg = cfg
        self.slots = slots
        self.dtype = dtype
        self.k = torch.empty(0)
        self.v = torch.empty(0)
        self.nbytes = 0
        """Bytes of cache storage held: counted where it changes (a worker reports it per command)."""
        self.allocate()

    @property
    def shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.n_layers, self.slots, c.n_heads, c.max_seq_len, c.head_dim)

    def allocate(self) -> None:
        self.k = torch.zeros(self.shape, dtype=self.dtype)
        self.v = torch.zeros(self.shape, dtype=self.dtype)
        self._counted()

    def free(self) -> None:
        """Release the storage (not just a flag): the tensors become empty."""
        self.k = torch.empty(0, dtype=self.dtype)
        self.v = torch.empty(0, dtype=self.dtype)
        self._counted()

    def _counted(self) -> None:
        self.nbytes = self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    @property
    def allocated(self) -> bool:
        return self.k.numel() > 0
