"""The reference engine: TinyLM on the Engine base, with a real generation loop and
optional speculative decoding (a draft TinyLM proposes k tokens, the verifier checks them).

Requests run as tasks that step one round at a time; the model lock is held only for one
round, so pause, sleep and weight loads slot in between rounds and never race a forward.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal

import anyio
import torch
from rlbus.schemas import GenerateReply, GenerateRequest, PauseMode, SleepTag, UpdateTarget
from rlbus.schemas.errors import FailedPrecondition

from rlbus.models.tinylm import KVCache, ModelConfig, TinyLM

from .engine import Engine, ParamSpec, TokenLabels, check_generate_request

StaleDraftPolicy = Literal["keep", "disable"]


class _Request:
    __slots__ = ("id", "abort", "frozen")

    def __init__(self, rid: int) -> None:
        self.id = rid
        self.abort = False
        self.frozen = False


class _Decode:
    """Per-request decode state: the token list and how much of it each KV cache holds."""

    __slots__ = ("tokens", "vpos", "dpos", "slot", "gen", "logprobs", "proposed", "accepted", "rounds", "produced")

    def __init__(self, prompt: list[int], slot: int, gen: torch.Generator | None) -> None:
        self.tokens = list(prompt)
        self.vpos = 0  # verifier cache holds tokens[:vpos]
        self.dpos = 0  # draft cache holds tokens[:dpos]
        self.slot = slot
        self.gen = gen
        self.logprobs: list[float] = []
        self.proposed = 0
        self.accepted = 0
        self.rounds = 0
        self.produced = 0


class _Part:
    """One model (verifier or draft) with its KV cache and its sleep backups."""

    def __init__(self, config: ModelConfig, slots: int) -> None:
        self.config = config
        self.model = TinyLM(config).eval()
        self.model.requires_grad_(False)
        self.kv = KVCache(config, slots, dtype=config.torch_dtype)
        self.specs = {n: ParamSpec(p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()}
        self.backup: dict[str, torch.Tensor] = {}
        self.saved_buffers: dict[str, torch.Tensor] = {}
        self.param_bytes = 0
        """Bytes of parameter storage resident (0 while the weights sleep). Every report of the
        worker's state carries it: it is counted only where the storages are replaced (here, at
        sleep and at wake; a load copies into them). Walking the parameters on every command's
        ack cost ~240 us at 1 GiB (256 tensors), over ten times the rest of a command's path."""
        self.live: Mapping[str, torch.Tensor] = {}
        """Each parameter's tensor by name (read-only), taken where the storages are replaced
        too: every update's receive reads it (building it walked the modules, ~320 us at 256
        tensors, on the metadata's way to the first byte)."""
        self._storages_changed()

    def _storages_changed(self) -> None:
        named = {n: p.data for n, p in self.model.named_parameters()}
        self.live = MappingProxyType(named)
        self.param_bytes = sum(t.untyped_storage().nbytes() for t in named.values())

    def sleep_weights(self, keep: bool) -> None:
        """Release parameter storage; keep=True keeps a host-side backup (and the buffers)."""
        if keep:
            self.backup = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
        else:
            self.backup = {}
        self.saved_buffers = {n: b.detach().to("cpu", copy=True) for n, b in self.model.named_buffers()}
        for b in self.model.buffers():
            b.data = torch.empty(0, dtype=b.dtype, device=b.device)
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._storages_changed()
        self.model.rotary.drop_tables()  # derived state goes with the weights

    def wake_weights(self) -> bool:
        """Reallocate parameters (from the backup when there is one); True if restored."""
        restored = bool(self.backup)
        params = dict(self.model.named_parameters())
        for name, spec in self.specs.items():
            params[name].data = self.backup[name] if restored else torch.zeros(spec.shape, dtype=spec.dtype)
        buffers = dict(self.model.named_buffers())
        for name, saved in self.saved_buffers.items():
            buffers[name].data = saved
        self.backup, self.saved_buffers = {}, {}
        self._storages_changed()
        self.rebuild_derived()
        return restored

    def rebuild_derived(self) -> None:
        self.model.rotary.rebuild()


class ReferenceEngine(Engine):
    """TinyLM with KV-cache slots, pause modes, sleep levels and optional speculation."""

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        model_name: str = "tiny-lm",
        max_concurrency: int = 8,
        sleep_mode_enabled: bool = True,
        draft_config: ModelConfig | None = None,
        num_speculative_tokens: int = 4,
        stale_draft_policy: StaleDraftPolicy = "keep",
        draft_updates_supported: bool = True,
    ) -> None:
        super().__init__(model_name, sleep_mode_enabled=sleep_mode_enabled)
        self.config = config or ModelConfig()
        self.main = _Part(self.config, max_concurrency)
        self.draft: _Part | None = None
        if draft_config is not None:
            if draft_config.vocab_size != self.config.vocab_size or draft_config.max_seq_len < self.config.max_seq_len:
                raise ValueError("the draft must share the verifier's vocabulary and cover its max_seq_len")
            self.draft = _Part(draft_config, max_concurrency)
        self.num_speculative_tokens = num_speculative_tokens
        self.stale_draft_policy = stale_draft_policy
        self._draft_updates_supported = draft_updates_supported
        self._slots = list(range(max_concurrency))
        self._slot_free = anyio.Semaphore(max_concurrency)
        self._model_lock = anyio.Lock()
        self._ids = itertools.count()
        self._running: dict[int, _Request] = {}
        self._weights_loaded = True

    # ---- identity ----------------------------------------------------------------------

    @property
    def model(self) -> TinyLM:
        """The verifier (main) model."""
        return self.main.model

    @property
    def has_draft_model(self) -> bool:
        return self.draft is not None

    @property
    def speculation_enabled(self) -> bool:
        return self.draft is not None and self.num_speculative_tokens > 0

    @property
    def supports_draft_weight_updates(self) -> bool:
        return self._draft_updates_supported and self.speculation_enabled

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in self.main.specs.values())

    # ---- state -------------------------------------------------------------------------

    def _parts(self) -> list[_Part]:
        return [self.main] + ([self.draft] if self.draft else [])

    @property
    def weights_loaded(self) -> bool:
        return self._weights_loaded

    @property
    def param_bytes(self) -> int:  # in every ack: no list, no generator
        draft = self.draft
        return self.main.param_bytes + (draft.param_bytes if draft is not None else 0)

    @property
    def kv_cache_bytes(self) -> int:
        draft = self.draft
        return self.main.kv.nbytes + (draft.kv.nbytes if draft is not None else 0)

    def _active(self) -> int:
        return len(self._running)

    def _speculating(self, request: GenerateRequest) -> bool:
        if not self.speculation_enabled or request.temperature > 0:
            return False  # greedy acceptance only: sampled requests decode plainly
        return not (self.draft_stale and self.stale_draft_policy == "disable")

    # ---- generation --------------------------------------------------------------------

    def _check_request(self, req: GenerateRequest) -> None:
        cfg = self.config
        check_generate_request(
            req, vocab_size=cfg.vocab_size, max_len=cfg.max_seq_len, max_len_name="the model's max_seq_len"
        )

    async def generate(self, request: GenerateRequest) -> GenerateReply:
        self._check_request(request)
        self._refuse_if_unservable()
        await self._wait_until_open()
        async with self._slot_free:
            await self._wait_until_open()  # a pause may have begun while we queued for a slot
            slot = self._slots.pop()
            req = _Request(next(self._ids))
            self._running[req.id] = req
            self._changes.notify()
            try:
                return await self._run(request, req, slot)
            finally:
                del self._running[req.id]
                self._slots.append(slot)
                self._changes.notify()

    async def _run(self, request: GenerateRequest, req: _Request, slot: int) -> GenerateReply:
        labels, draft_version = TokenLabels(self.book.main), self.book.draft.version
        gen = None
        if request.temperature > 0:
            gen = torch.Generator().manual_seed(request.seed if request.seed is not None else 0)
        st = _Decode(request.prompt_tokens, slot, gen)
        finish = "length"
        while st.produced < request.max_tokens:
            if req.abort:
                finish = "abort"
                break
            if self._paused and self._pause_mode == "keep":
                req.frozen = True
                self._changes.notify()
                await self._changes.until(lambda: not self._paused or req.abort)
                req.frozen = False
                continue
            async with self._model_lock:
                self._refuse_if_unservable()
                label = self.book.main  # a load changes the weights, and their label, only under this lock
                produced = st.produced
                remaining = request.max_tokens - st.produced
                if self._speculating(request) and remaining > 1:
                    await anyio.to_thread.run_sync(
                        self._spec_round, st, min(self.num_speculative_tokens, remaining - 1)
                    )
                else:
                    await anyio.to_thread.run_sync(self._plain_step, st, request.temperature)
                labels.add(label, st.produced - produced)
        out = st.tokens[len(request.prompt_tokens) :][: request.max_tokens]
        self.spec_proposed += st.proposed
        self.spec_accepted += st.accepted
        return GenerateReply(
            worker_id="",
            tokens=out,
            finish_reason=finish,  # type: ignore[arg-type]
            **labels.reply_fields(len(out)),
            draft_version=draft_version if st.rounds else None,
            logprobs=st.logprobs[: len(out)] if request.return_logprobs else None,
            proposed=st.proposed,
            accepted=st.accepted,
            mean_accepted_length=st.accepted / st.rounds if st.rounds else 0.0,
        )

    @torch.inference_mode()
    def _plain_step(self, st: _Decode, temperature: float) -> None:
        m = self.main
        logits = m.model(torch.tensor(st.tokens[st.vpos :], dtype=torch.long), m.kv, st.slot, st.vpos)[-1]
        st.vpos = len(st.tokens)
        logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
        if temperature > 0:
            token = int(torch.multinomial(logp.exp(), 1, generator=st.gen).item())
        else:
            token = int(torch.argmax(logits).item())
        st.tokens.append(token)
        st.logprobs.append(float(logp[token].item()))
        st.produced += 1

    @torch.inference_mode()
    def _spec_round(self, st: _Decode, k: int) -> None:
        """Draft proposes k tokens; the verifier scores them in one forward; greedy acceptance
        keeps the longest agreeing prefix plus the verifier's own next token, so the output
        is exactly what the verifier alone would produce."""
        d, m = self.draft, self.main
        assert d is not None
        n = len(st.tokens)
        proposals: list[int] = []
        feed, start = st.tokens[st.dpos :], st.dpos
        for _ in range(k):
            logits = d.model(torch.tensor(feed, dtype=torch.long), d.kv, st.slot, start)[-1]
            start += len(feed)
            tok = int(torch.argmax(logits).item())
            proposals.append(tok)
            feed = [tok]
        draft_valid = start  # the draft cache holds tokens + proposals[:-1]
        logits = m.model(torch.tensor(st.tokens[st.vpos :] + proposals, dtype=torch.long), m.kv, st.slot, st.vpos)
        # logits row j predicts the token at absolute position st.vpos + j + 1
        base = n - 1 - st.vpos
        verdict = torch.argmax(logits[base:], dim=-1).tolist()  # k+1 verifier choices
        logp = torch.log_softmax(logits[base:].float(), dim=-1)
        accepted = 0
        while accepted < k and proposals[accepted] == verdict[accepted]:
            accepted += 1
        new = proposals[:accepted] + [verdict[accepted]]
        for j, tok in enumerate(new):
            st.logprobs.append(float(logp[j, tok].item()))
        st.tokens.extend(new)
        st.produced += len(new)
        st.vpos = n + accepted
        st.dpos = min(draft_valid, n + accepted)
        st.proposed += k
        st.accepted += accepted
        st.rounds += 1

    # ---- pause / resume ----------------------------------------------------------------

    async def _on_pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            for r in self._running.values():
                r.abort = True
            self._changes.notify()
        if mode == "keep":
            await self._changes.until(lambda: all(r.frozen for r in self._running.values()))
        else:
            await self._changes.until(lambda: not self._running)

    # ---- sleep / wake ------------------------------------------------------------------

    async def _on_sleep(self, level: int, tags: list[SleepTag]) -> None:
        async with self._model_lock:
            if "weights" in tags:
                # level 1 backs the verifier up to the host; level 2 discards it. The draft is
                # always saved: nothing else would restore it, and a lost draft means no speedup.
                self.main.sleep_weights(keep=level == 1)
                if self.draft:
                    self.draft.sleep_weights(keep=True)
                if level == 2:
                    self._weights_loaded = False
            if "kv_cache" in tags:
                for p in self._parts():
                    p.kv.free()

    async def _on_wake(self, tags: list[SleepTag]) -> None:
        async with self._model_lock:
            if "weights" in tags:
                self.main.wake_weights()
                if self.draft:
                    self.draft.wake_weights()
            if "kv_cache" in tags:
                for p in self._parts():
                    p.kv.allocate()

    # ---- weights -----------------------------------------------------------------------

    def _part(self, target: UpdateTarget) -> _Part:
        if target == "draft":
            if self.draft is None:
                raise FailedPrecondition("this engine has no draft model")
            if not self._draft_updates_supported:
                raise FailedPrecondition("this engine's backend cannot update the draft model")
            return self.draft
        return self.main

    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]:
        return self._part(target).specs

    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        return self._part(target).live

    async def load_weights(
        self,
        target: UpdateTarget,
        tensors: Mapping[str, torch.Tensor],
        written: set[str] | None = None,
        *,
        loaded: Callable[[], None] = lambda: None,
    ) -> None:
        part = self._part(target)
        async with self._model_lock:
            if "weights" in self._sleeping:
                raise FailedPrecondition("weights are asleep; wake_up(tags=['weights']) before loading")
            params = dict(part.model.named_parameters())
            for name, t in tensors.items():
                params[name].data.copy_(t)
            part.rebuild_derived()
            covered = set(tensors) | (written or set())
            if target == "main":
                if covered >= set(part.specs):
                    self._weights_loaded = True
                if covered and self.draft is not None:
                    self.draft_stale = True
            elif covered:
                self.draft_stale = False
            loaded()  # still under the model lock: no step runs on these weights before it
        self._changes.notify()
