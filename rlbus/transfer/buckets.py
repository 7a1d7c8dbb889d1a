"""Bucket planning and packing: many named tensors <-> a few fixed-size byte buffers.

A plan assigns every tensor a byte range inside a bucket (big tensors alone, small ones
packed in input order); each range starts on a 64-byte boundary so the bytes can be
viewed back as any dtype without copying. Pad bytes are zeroed, so a bucket's checksum depends only on the
tensors' bytes.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence

import torch

from rlbus.schemas import BucketMeta, DType, ParamMeta
from rlbus.transfer.base import PlanError, UnsupportedDType

ALIGN = 64
"""Every tensor (and every bucket inside a pool) starts on this byte boundary."""

_TO_TORCH: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_TO_NAME: dict[torch.dtype, DType] = {v: k for k, v in _TO_TORCH.items()}  # type: ignore[misc]
_ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in _TO_TORCH.items()}


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def dtype_name(dtype: torch.dtype) -> DType:
    """The wire name of a torch dtype; UnsupportedDType for one the contract lacks."""
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise UnsupportedDType(f"dtype {dtype} cannot be sent; supported: {sorted(_TO_TORCH)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name; UnsupportedDType for an unknown name."""
    try:
        return _TO_TORCH[name]
    except KeyError:
        raise UnsupportedDType(f"unknown dtype {name!r}; supported: {sorted(_TO_TORCH)}") from None


def itemsize(dtype: str) -> int:
    """Bytes of one element of a wire dtype; UnsupportedDType for an unknown name."""
    return _ITEMSIZE.get(dtype) or torch_dtype(dtype).itemsize


VALUES_ALIGN = 8
"""A delta's values start this aligned after its index block (any dtype can be viewed in place)."""


def delta_index_nbytes(index: str, changed: int, numel: int) -> int:
    """Bytes of a delta's index block: int32 indices, or a bitmap of ``numel`` bits."""
    return 4 * changed if index == "int32" else (numel + 7) // 8


def delta_layout_problem(m: ParamMeta) -> str | None:
    """Why a delta ParamMeta's sizes are inconsistent (None when they agree with each other)."""
    numel = math.prod(m.shape)
    size = itemsize(m.dtype)
    if not 1 <= m.changed <= numel:
        return f"changed {m.changed} outside 1..{numel}"
    if m.index_nbytes != delta_index_nbytes(m.index, m.changed, numel):
        return f"index_nbytes {m.index_nbytes} does not match {m.index} for {m.changed} of {numel} elements"
    if m.values_offset != align_up(m.index_nbytes, VALUES_ALIGN):
        return f"values_offset {m.values_offset} is not index_nbytes rounded up to {VALUES_ALIGN}"
    if m.nbytes != m.values_offset + m.changed * size:
        return f"nbytes {m.nbytes} != values_offset + changed x {size}"
    if m.offset % VALUES_ALIGN:
        return f"offset {m.offset} is not a multiple of {VALUES_ALIGN}"
    return None


_MEMMOVE_BELOW = 1 << 20
"""pack copies a tensor smaller than this with ctypes.memmove (see pack)."""

SOLO_FRACTION = 4
"""By default a tensor of at least 1/SOLO_FRACTION of a bucket travels in a bucket of its own. A quarter,
not a half: packing costs a copy on the trainer and one on every receiver, which on gloo cost
more than the extra broadcasts (bench/push.py, tinylm's 4 MiB tensors in 16 MiB buckets:
2.4 GB/s alone against 1.8-2.1 packed at R = 1, 1.4 against 1.0-1.3 at R = 2)."""


def default_solo_bytes(bucket_bytes: int) -> int:
    """The least size of a tensor that travels alone when nothing else is asked for: a
    quarter of a bucket (:data:`SOLO_FRACTION`), rounded up."""
    return -(-bucket_bytes // SOLO_FRACTION)


def plan(
    named: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    max_tensors: int | None = None,
    solo_bytes: int | None = None,
) -> tuple[list[ParamMeta], list[int]]:
    """Assign every tensor a 64-byte-aligned range in a bucket.

    A tensor of at least ``solo_bytes`` (by default a quarter of a bucket, see
    :data:`SOLO_FRACTION`; a transport whose every bucket costs little on its own asks for
    less, see ``stream.solo_bytes``) travels alone, in a bucket of exactly its size
    (larger than ``bucket_bytes`` if the tensor is): it is sent straight from the
    tensor's memory and, where the receiver can, lands straight in its destination, so
    it is never copied and never splits a shared bucket. The smaller tensors are packed,
    in input order, into shared buckets of at most ``bucket_bytes``. Returns the ParamMeta
    list (input order) and the byte size of every bucket (numbered in order of first use).
    ``max_tensors`` caps the tensors of a shared bucket, so its metadata fits one message.
    """
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if solo_bytes is None:
        solo_bytes = default_solo_bytes(bucket_bytes)
    elif solo_bytes <= 0:
        raise PlanError(f"solo_bytes must be positive, got {solo_bytes}")
    solo_bytes = min(solo_bytes, bucket_bytes)  # a shared bucket never holds more than bucket_bytes
    metas: list[ParamMeta] = []
    sizes: list[int] = []
    seen: set[str] = set()
    shared: int | None = None  # index of the open shared bucket
    end = 0  # bytes used in it
    count = 0  # tensors in it

    def close() -> None:
        nonlocal shared
        if shared is not None:
            sizes[shared] = min(align_up(end), bucket_bytes)
        shared = None

    for name, t in named:
        if name in seen:
            raise PlanError(f"tensor name {name!r} appears twice")
        seen.add(name)
        dtype = dtype_name(t.dtype)
        nbytes = t.numel() * t.element_size()
        shape = list(t.shape)
        if nbytes and nbytes >= solo_bytes:
            metas.append(ParamMeta(name=name, dtype=dtype, shape=shape, bucket=len(sizes), offset=0, nbytes=nbytes))
            sizes.append(nbytes)  # exactly the tensor: sent from it and landed in it as they are
            continue
        offset = align_up(end)
        if shared is not None and (
            offset + nbytes > bucket_bytes or (max_tensors is not None and count >= max_tensors)
        ):
            close()
        if shared is None:
            shared, offset, count = len(sizes), 0, 0
            sizes.append(0)
        count += 1
        metas.append(ParamMeta(name=name, dtype=dtype, shape=shape, bucket=shared, offset=offset, nbytes=nbytes))
        end = offset + nbytes
    close()
    return metas, sizes


def by_bucket(metas: Sequence[ParamMeta], num_buckets: int) -> list[list[ParamMeta]]:
    """The metas of each bucket, each list in offset order."""
    out: list[list[ParamMeta]] = [[] for _ in range(num_buckets)]
    for m in metas:
        out[m.bucket].append(m)
    for group in out:
        group.sort(key=lambda m: m.offset)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a contiguous copy first if it is strided)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def pack(
    bucket_index: int,
    metas: Sequence[ParamMeta],
    named_lookup: Mapping[str, torch.Tensor],
    out: torch.Tensor,
) -> torch.Tensor:
    """Copy the bytes of every tensor of bucket ``bucket_index`` into ``out``.

    ``metas`` may hold every ParamMeta of the plan or just this bucket's. ``out`` is
    a contiguous uint8 buffer of at least the bucket's size, on any device (the group's: CUDA
    for NCCL, so GPU tensors are packed where they live); gaps between tensors (and up to the
    last tensor's aligned end) are zeroed. Returns ``out``. On the host, small contiguous
    tensors are copied with one memmove each, not through two torch views (~1 us a tensor
    instead of ~6); big ones, and any off the host, with torch.
    """
    if out.dtype != torch.uint8 or not out.is_contiguous():
        raise PlanError("pack needs a contiguous uint8 output buffer")
    mine = sorted((m for m in metas if m.bucket == bucket_index), key=lambda m: m.offset)
    host = out.device.type == "cpu"
    base, size = out.data_ptr(), out.numel()

    def zero(a: int, b: int) -> None:
        if host:
            ctypes.memset(base + a, 0, b - a)
        else:
            out[a:b].zero_()

    pos = 0
    for m in mine:
        t = named_lookup.get(m.name)
        if t is None:
            raise PlanError(f"tensor {m.name!r} of the plan is missing")
        if _TO_NAME.get(t.dtype) != m.dtype or t.numel() * t.element_size() != m.nbytes:
            raise PlanError(f"tensor {m.name!r} changed since planning (dtype/shape)")
        if m.offset + m.nbytes > size:
            raise PlanError(f"tensor {m.name!r} does not fit the output buffer")
        if m.offset > pos:
            zero(pos, m.offset)
        if m.nbytes:
            if host and m.nbytes < _MEMMOVE_BELOW and t.is_cpu and t.is_contiguous():
                ctypes.memmove(base + m.offset, t.data_ptr(), m.nbytes)
            else:
                out[m.offset : m.offset + m.nbytes].copy_(as_bytes(t))
        pos = max(pos, m.offset + m.nbytes)
    tail = min(align_up(pos), size)
    if tail > pos:
        zero(pos, tail)
    return out


def unpack(buf: torch.Tensor, metas_of_bucket: Sequence[ParamMeta]) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views into ``buf``, one per tensor, with its dtype and shape.

    The views alias ``buf``: copy them before the buffer is reused.
    """
    out: list[tuple[str, torch.Tensor]] = []
    for m in metas_of_bucket:
        raw = buf[m.offset : m.offset + m.nbytes]
        # a delta's bytes stay raw (index block + values): rlbus.transfer.delta decodes them
        out.append((m.name, raw if m.encoding != "dense" else raw.view(torch_dtype(m.dtype)).view(m.shape)))
    return out


def copy_out(
    buf: torch.Tensor, metas_of_bucket: Sequence[ParamMeta], into: Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Copy every tensor of a host bucket straight into ``into[name]`` and return ``(name, that
    tensor)``; a tensor with no such destination (missing, strided, another size, off the host,
    or big: torch copies those faster) comes back as a view into ``buf``, as :func:`unpack`
    gives."""
    base = buf.data_ptr()
    out: list[tuple[str, torch.Tensor]] = []
    for m in metas_of_bucket:
        d = into.get(m.name) if m.encoding == "dense" and buf.is_cpu else None
        if (
            d is not None
            and m.nbytes < _MEMMOVE_BELOW
            and d.is_cpu
            and d.is_contiguous()
            and d.numel() * d.element_size() == m.nbytes
            and m.offset + m.nbytes <= buf.numel()
        ):
            ctypes.memmove(d.data_ptr(), base + m.offset, m.nbytes)
            out.append((m.name, d))
        else:
            out.extend(unpack(buf, [m]))
    return out


def validate(params: Sequence[ParamMeta], buckets: Sequence[BucketMeta]) -> None:
    """Check metadata a worker received before any byte moves; PlanError if inconsistent.

    Buckets must be numbered 0..n-1 in order; every tensor must have a known dtype,
    a byte count that matches its shape, and a range inside its bucket that
    overlaps no other tensor; names must be unique.
    """
    for i, b in enumerate(buckets):
        if b.index != i:
            raise PlanError(f"bucket {i} has index {b.index}; buckets must be numbered 0..n-1 in order")
        if b.nbytes < 0:
            raise PlanError(f"bucket {i} has negative size")
    # one loop over every tensor of a command (hundreds, or thousands for a mixture of experts)
    # on each worker before any byte moves: the meta's fields and the bucket sizes read once
    sizes = [b.nbytes for b in buckets]
    count = len(sizes)
    names: set[str] = set()
    for m in params:
        name, shape, nbytes, bucket, offset = m.name, m.shape, m.nbytes, m.bucket, m.offset
        if name in names:
            raise PlanError(f"tensor name {name!r} appears twice")
        names.add(name)
        if shape and min(shape) < 0:
            raise PlanError(f"tensor {name!r} has a negative dimension")
        dense = m.encoding == "dense"
        size = itemsize(m.dtype) if dense else 1
        if dense and math.prod(shape) * size != nbytes:
            raise PlanError(f"tensor {name!r}: nbytes {nbytes} does not match {m.dtype}{shape}")
        if not dense and (problem := delta_layout_problem(m)):
            raise PlanError(f"delta of tensor {name!r}: {problem}")
        if not 0 <= bucket < count:
            raise PlanError(f"tensor {name!r} names bucket {bucket}, there are {count}")
        if offset < 0 or offset + nbytes > sizes[bucket]:
            raise PlanError(f"tensor {name!r} lies outside bucket {bucket}")
        if offset % size:
            raise PlanError(f"tensor {name!r} is misaligned for {m.dtype}")
    for group in by_bucket(params, len(buckets)):
        for a, b in zip(group, group[1:]):
            if a.nbytes and b.nbytes and a.offset + a.nbytes > b.offset:
                raise PlanError(f"tensors {a.name!r} and {b.name!r} overlap in bucket {a.bucket}")
