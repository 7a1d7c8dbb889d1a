"""Tensor metadata for weight updates. Bytes never ride on NATS; these describe them."""

from __future__ import annotations

from typing import Literal

import msgspec

from .state import Backend

DType = Literal[
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"
]


class ParamMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Where one named tensor lives inside the bucket stream."""

    name: str
    dtype: DType
    shape: list[int]
    bucket: int
    """Index of the bucket holding the tensor's bytes."""
    offset: int
    """Byte offset of the tensor inside its bucket."""
    nbytes: int


class BucketMeta(msgspec.Struct, frozen=True, kw_only=True):
    """One fixed-size block of bytes on the data plane."""

    index: int
    nbytes: int
    """Its checksum is computed as the bucket leaves the trainer and reaches the workers
    with FinishWeightUpdate (rlbus.transfer.stream)."""


class TransferInit(msgspec.Struct, frozen=True, kw_only=True):
    """Rendezvous for a weight-transfer group, chosen by the trainer (rank 0)."""

    backend: Backend
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 0
    """Trainer + every worker."""
    rank_offset: int = 1
    """Worker i (in the controller's stable order) is rank rank_offset + i."""
    group_name: str = ""
    """Unique per group; prefixes the rendezvous store and names the shm segment."""
    timeout_s: float = 60.0
    """Timeout of every collective; no rank may hang forever."""


CHECKSUM_HEX_DIGITS = 32
"""An xxh3-128 checksum as lowercase hex."""


def checksums_problem(checksums: list[str]) -> str | None:
    """Why a list of bucket checksums is not acceptable, or None when it is."""
    for k, c in enumerate(checksums):
        if len(c) != CHECKSUM_HEX_DIGITS or c.strip("0123456789abcdef"):
            return f"checksum {k} is not {CHECKSUM_HEX_DIGITS} lowercase hex digits: {c[:40]!r}"
    return None
