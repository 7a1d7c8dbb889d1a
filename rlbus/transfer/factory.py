"""Pick a transfer backend by its wire name."""

from __future__ import annotations

from rlbus.schemas import Backend
from rlbus.transfer.base import TrainerTransfer, WorkerTransfer
from rlbus.transfer.shm import ShmTrainer, ShmWorker
from rlbus.transfer.torchdist import TorchDistTrainer, TorchDistWorker

BACKENDS: tuple[Backend, ...] = ("nccl", "gloo", "shm")


def trainer_transfer(name: Backend) -> TrainerTransfer:
    """The trainer (rank 0) side of backend ``name``; ValueError for an unknown name."""
    if name == "shm":
        return ShmTrainer()
    if name in ("gloo", "nccl"):
        return TorchDistTrainer(name)
    raise ValueError(f"unknown transfer backend {name!r}; expected one of {BACKENDS}")


def worker_transfer(name: Backend) -> WorkerTransfer:
    """The worker side of backend ``name``; ValueError for an unknown name."""
    if name == "shm":
        return ShmWorker()
    if name in ("gloo", "nccl"):
        return TorchDistWorker(name)
    raise ValueError(f"unknown transfer backend {name!r}; expected one of {BACKENDS}")
