"""Tensor metadata for weight updates. Bytes never ride on NATS; these describe them."""

from __future__ import annotations

from typing import Literal

import msgspec

from .state import Backend

DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
Encoding = Literal["dense", "delta"]
"""How a tensor's bytes travel: all of them, or only the elements whose bits changed."""
DeltaIndex = Literal["int32", "bitmap"]
"""How a delta names its changed elements: sorted int32 flat indices, or a bitmap of numel bits."""


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
    """Bytes it takes in the bucket: the tensor's (dense), or index block + padding + values (delta)."""
    encoding: Encoding = "dense"
    """dense: the tensor's bytes. delta: only the elements whose bits differ from the session's
    base (`start_weight_update` with `base_seq`): the index block at `offset`, then `changed`
    values of `dtype` at `offset + values_offset`; the worker writes them onto its copy of the
    base and checks the result against the trainer's `TensorChecksum` at finish."""
    index: DeltaIndex = "int32"
    """delta: int32 = `changed` flat element indices (little-endian, ascending, unique);
    bitmap = ceil(numel / 8) bytes, bit j of byte i set for element 8i + j (little-endian bit
    order, bits past numel zero), values in element order."""
    changed: int = 0
    """delta: the number of elements sent (1..numel)."""
    index_nbytes: int = 0
    """delta: bytes of the index block (int32: 4 x changed; bitmap: ceil(numel / 8))."""
    values_offset: int = 0
    """delta: where the values start, from `offset`: index_nbytes rounded up to 8."""


class TensorChecksum(msgspec.Struct, frozen=True, kw_only=True):
    """The xxh3-128 of one tensor's full bytes after the update (what the worker must hold)."""

    name: str
    checksum: str
    """32 lowercase hex digits."""


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


def tensor_checksums_problem(sums: list[TensorChecksum]) -> str | None:
    """Why a list of tensor checksums is not acceptable, or None when it is."""
    names = [c.name for c in sums]
    if len(set(names)) != len(names):
        return "tensor_checksums name a tensor twice"
    return checksums_problem([c.checksum for c in sums])


def checksums_problem(checksums: list[str]) -> str | None:
    """Why a list of bucket checksums is not acceptable, or None when it is."""
    for k, c in enumerate(checksums):
        if len(c) != CHECKSUM_HEX_DIGITS or c.strip("0123456789abcdef"):
            return f"checksum {k} is not {CHECKSUM_HEX_DIGITS} lowercase hex digits: {c[:40]!r}"
    return None
