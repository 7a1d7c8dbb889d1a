"""A worker's reported state carries every field of its engine's status."""

from __future__ import annotations

import msgspec
from rlbus.services.worker.engine import EngineStatus
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions, WorkerService

from rlbus.models.tinylm import ModelConfig


def _unusual_status() -> EngineStatus:
    return EngineStatus(
        paused=True,
        pause_mode="keep",
        sleeping_tags=["kv_cache"],
        sleep_level=1,
        weights_loaded=False,
        in_flight=3,
        waiting=4,
        param_bytes=5,
        kv_cache_bytes=6,
        draft_stale=True,
        spec_proposed=8,
        spec_accepted=9,
    )


def test_every_engine_status_field_reaches_the_worker_state():
    engine = ReferenceEngine(ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_seq_len=16))
    status = _unusual_status()
    engine.status = lambda: status  # type: ignore[method-assign]
    state = WorkerService(None, engine, WorkerOptions(worker_id="w0")).state()  # type: ignore[arg-type]
    fields = msgspec.structs.fields(EngineStatus)
    assert fields, "EngineStatus has fields"
    for f in fields:
        assert getattr(state, f.name) == getattr(status, f.name), f.name
        assert getattr(status, f.name) != f.default, f"{f.name}: the test's status must differ from the default"
