"""A model folder's checkpoint: the names, dtypes and shapes a trainer's transformers model
sends (what `save_pretrained` wrote), and the tensors themselves.

vLLM renames and repacks parameters (qkv_proj, gate_up_proj; on CPU the live Linear
weights have shape (0,)), so rlbus checks updates against the checkpoint, never against
vLLM's live parameters. Needs `safetensors` (it comes with transformers), not vllm.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from rlbus.schemas.errors import FailedPrecondition

from ..engine import ParamSpec

WEIGHTS_FILE = "model.safetensors"


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FailedPrecondition(
            f"{folder} holds no *.safetensors checkpoint (save_pretrained(safe_serialization=True) writes one)"
        )
    return files


def read_specs(folder: str | Path) -> dict[str, ParamSpec]:
    """Name -> (dtype, shape) of every tensor in the folder's safetensors, without reading the bytes."""
    from safetensors import safe_open

    specs: dict[str, ParamSpec] = {}
    for path in _files(Path(folder)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                specs[name] = ParamSpec(_DTYPES[sl.get_dtype()], tuple(sl.get_shape()))
    return specs


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's checkpoint, as CPU tensors."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in _files(Path(folder)):
        out.update(load_file(str(path), device="cpu"))
    return out


def write_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """One safetensors file (what the transfer engine inside vLLM reads)."""
    from safetensors.torch import save_file

    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(path))


def write_model_folder(source: str | Path, dest: str | Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """A copy of the model folder `source` (config and all) whose checkpoint is `tensors`:
    what a restarted vLLM loads to serve exactly the last committed weights."""
    src, dst = Path(source), Path(dest)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and not item.name.endswith(".safetensors.index.json"):
            shutil.copy2(item, dst / item.name)
    write_tensors(dst / WEIGHTS_FILE, tensors)
    return dst


_DTYPES = {  # safetensors dtype names (segment.py reads them too)
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def write_toy_model(
    folder: str | Path,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 512,
    max_positions: int = 512,
    init_std: float = 0.3,
) -> Path:
    """A small Qwen2 model folder (no hub needed) for the demo and the tests: 2 heads of
    64/2 = 32 dims (the smallest head size vLLM's CPU attention supports), tied embeddings.
    init_std well above transformers' 0.02 makes greedy decoding decisive, not a coin toss
    between near-equal logits, so two implementations agree token for token."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, init_std)
    model.save_pretrained(str(folder), safe_serialization=True)
    return Path(folder)
