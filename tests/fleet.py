"""Helpers to start an in-process fleet in a test module (not a test file)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager

from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.models.tinylm import ModelConfig
from rlbus.runners.children import spawn
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient

SMALL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=128, seed=0)
LONG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=256, seed=0)
"""Room for long generations: a pause, sleep or drain lands while every request still decodes."""
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


async def start_fleet(
    url: str,
    prefix: str,
    worker_ids: Sequence[str] = ("w0", "w1"),
    *,
    sleep_mode: bool = True,
    command_timeout_s: float = 10.0,
    liveness_timeout_s: float = 1.5,
    heartbeat_s: float = 0.25,
    model: ModelConfig = SMALL,
    engine_kw: dict[str, object] | None = None,
    **worker_kw: object,
) -> tuple[LocalFleet, RLClient]:
    subjects = Subjects(prefix=prefix)
    fleet = LocalFleet(url)
    await fleet.start_controller(
        ControllerOptions(subjects=subjects, command_timeout_s=command_timeout_s, liveness_timeout_s=liveness_timeout_s)
    )
    for wid in worker_ids:
        await fleet.start_worker(
            ReferenceEngine(model, sleep_mode_enabled=sleep_mode, **(engine_kw or {})),  # type: ignore[arg-type]
            WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=heartbeat_s, **worker_kw),  # type: ignore[arg-type]
        )
    await fleet.wait_for_workers(worker_ids)
    rl = await RLClient.connect(url, prefix=prefix, timeout=30.0)
    return fleet, rl


@asynccontextmanager
async def fleet_running(
    url: str, prefix: str, *args: object, **kw: object
) -> AsyncIterator[tuple[LocalFleet, RLClient]]:
    """start_fleet(...) for the body of an `async with` (a module fixture's yield); the client
    and every service are closed after it, whatever happened."""
    fleet, rl = await start_fleet(url, prefix, *args, **kw)  # type: ignore[arg-type]
    try:
        yield fleet, rl
    finally:
        await rl.close()
        await fleet.close()


def worker_command(
    url: str, prefix: str, worker_id: str, backend: str, model: ModelConfig = SMALL, heartbeat: float = 0.2
) -> list[str]:
    """`rlbus worker` as a real process, hosting the reference engine with `model`'s shape."""
    return [
        sys.executable,
        "-m",
        "rlbus",
        "worker",
        "--nats-url",
        url,
        "--prefix",
        prefix,
        "--id",
        worker_id,
        "--weight-transfer-backend",
        backend,
        "--heartbeat",
        str(heartbeat),
        "--vocab-size",
        str(model.vocab_size),
        "--d-model",
        str(model.d_model),
        "--n-layers",
        str(model.n_layers),
        "--n-heads",
        str(model.n_heads),
        "--max-seq-len",
        str(model.max_seq_len),
        "--seed",
        str(model.seed),
    ]


def controller_process(url: str, prefix: str, *flags: str) -> subprocess.Popen:
    """`rlbus controller` as a real process (given `flags` too), its output discarded."""
    return spawn(
        [sys.executable, "-m", "rlbus", "controller", "--nats-url", url, "--prefix", prefix, *flags],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextmanager
def nccl_worker(url: str, prefix: str, worker_id: str, model: ModelConfig, *flags: str) -> Iterator[subprocess.Popen]:
    """`rlbus worker` over nccl as a process on the last GPU (NCCL refuses two ranks on one GPU,
    "Duplicate GPU detected": the trainer keeps cuda:0), given `flags` too; stopped after the body."""
    import torch

    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(torch.cuda.device_count() - 1), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [*worker_command(url, prefix, worker_id, "nccl", model, heartbeat=0.25), *flags],
        env=env,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
