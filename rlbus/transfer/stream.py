"""The hot path: named tensors -> checksummed buckets -> the wire -> a sink, on both sides.

Workers must see every bucket's checksum (in ``UpdateWeights``) before the first
byte moves, so checksums exist before sending. Two ways to get there:

* **pack once** (:func:`pack_all` then :func:`send_packed`) — the default and the
  fastest: every bucket is packed into one reusable pool, hashed, and later sent
  straight from the pool. Each byte of the model is read once to pack and once to
  hash; sending needs no further copy. Cost: host memory for one packed copy of
  the model (pass the previous ``Packed.pool`` back in to reuse it every step).
* **pack twice** (:func:`checksums` then :func:`send_buckets`) — constant memory
  (two buckets): a first pass packs each bucket into scratch only to hash it; the
  send pass packs again, bucket ``k+1`` while bucket ``k`` is on the wire. Costs a
  second read of the model; use it when a packed copy does not fit in RAM. The
  tensors must not change between the two passes.

At most two buckets are in flight on either side, which bounds staging memory
(nccl) and matches the shm backend's two slots. The receiver verifies bucket
``k`` and hands its tensors to the sink while bucket ``k+1`` arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rlbus.schemas import BucketMeta, ParamMeta
from rlbus.transfer.base import ChecksumMismatch, Handle, PlanError, TrainerTransfer, WorkerTransfer
from rlbus.transfer.buckets import align_up, by_bucket, pack, plan, unpack, validate
from rlbus.transfer.checksum import checksum

DEFAULT_BUCKET_BYTES = 64 << 20
Named = Sequence[tuple[str, torch.Tensor]]
Sink = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class Plan:
    """Where every tensor goes: its ParamMeta and the size of every bucket."""

    params: list[ParamMeta]
    bucket_sizes: list[int]
    per_bucket: list[list[ParamMeta]] = field(repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def max_bucket(self) -> int:
        return max(self.bucket_sizes, default=0)


@dataclass(frozen=True)
class Packed:
    """Every bucket of a plan packed into one pool, with its checksum."""

    plan: Plan
    pool: torch.Tensor
    """Reusable: pass it to the next :func:`pack_all`."""
    buffers: list[torch.Tensor]
    """Bucket ``k``'s bytes: a view into ``pool`` of exactly its size."""
    buckets: list[BucketMeta]


def prepare(named: Named, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """Plan the buckets for ``named`` (input order, 64-byte aligned)."""
    params, sizes = plan(named, bucket_bytes)
    return Plan(params=params, bucket_sizes=sizes, per_bucket=by_bucket(params, len(sizes)))


def alloc_buffers(nbytes: int, count: int = 2) -> list[torch.Tensor]:
    """``count`` uint8 buffers of ``nbytes``, pages already touched (zeroed)."""
    return [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]


def pack_and_checksum(p: Plan, named: Named | Mapping[str, torch.Tensor],
                      scratch: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor, str]]:
    """Yield ``(index, bytes, checksum)`` per bucket, packed into one scratch buffer.

    The yielded tensor is overwritten by the next bucket.
    """
    lookup = _lookup(named)
    buf = scratch if scratch is not None and scratch.numel() >= p.max_bucket else alloc_buffers(p.max_bucket, 1)[0]
    for k, size in enumerate(p.bucket_sizes):
        out = buf[:size]
        pack(k, p.per_bucket[k], lookup, out)
        yield k, out, checksum(out)


def checksums(p: Plan, named: Named | Mapping[str, torch.Tensor]) -> list[BucketMeta]:
    """Pass one of pack-twice: the BucketMeta of every bucket, in constant memory."""
    return [BucketMeta(index=k, nbytes=buf.numel(), checksum=c) for k, buf, c in pack_and_checksum(p, named)]


def pool_layout(p: Plan) -> tuple[list[int], int]:
    """Offsets of every bucket in a packing pool, and the pool's size."""
    offsets, end = [], 0
    for size in p.bucket_sizes:
        offsets.append(end)
        end = align_up(end + size)
    return offsets, end


def pool_views(p: Plan, pool: torch.Tensor) -> list[torch.Tensor]:
    """Bucket ``k``'s region of a pool at least ``pool_layout(p)[1]`` bytes long."""
    offsets, end = pool_layout(p)
    if pool.numel() < end:
        raise PlanError(f"pool of {pool.numel()} bytes is smaller than the plan's {end}")
    return [pool[off : off + size] for off, size in zip(offsets, p.bucket_sizes)]


def pack_range(p: Plan, named: Named | Mapping[str, torch.Tensor], buffers: list[torch.Tensor],
               first: int, last: int) -> list[BucketMeta]:
    """Pack and hash buckets first..last-1 into their pool regions (`buffers` is updated in
    place). A bucket that is exactly one contiguous CPU tensor is not copied at all: its
    buffer becomes a byte view of the tensor itself."""
    lookup = _lookup(named)
    metas = []
    for k in range(first, last):
        direct = sole_tensor_bytes(p.per_bucket[k], p.bucket_sizes[k], lookup)
        if direct is not None:
            buffers[k] = direct
        else:
            pack(k, p.per_bucket[k], lookup, buffers[k])
        metas.append(BucketMeta(index=k, nbytes=p.bucket_sizes[k], checksum=checksum(buffers[k])))
    return metas


def sole_tensor_bytes(metas: Sequence[ParamMeta], size: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The bytes of a bucket that is exactly one contiguous CPU tensor, as a uint8 view of
    that tensor's own memory (None otherwise). The trainer sends such a bucket from the
    tensor itself; an in_place worker receives it straight into its live parameter."""
    if len(metas) != 1 or metas[0].offset != 0 or metas[0].nbytes != size:
        return None
    t = tensors.get(metas[0].name)
    if t is None or t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def pack_all(p: Plan, named: Named | Mapping[str, torch.Tensor], *, pool: torch.Tensor | None = None) -> Packed:
    """Pack every bucket once into a pool (reused when big enough) and hash it."""
    _, end = pool_layout(p)
    if pool is None or pool.numel() < end:
        pool = torch.empty(end, dtype=torch.uint8)
    buffers = pool_views(p, pool)
    metas = pack_range(p, named, buffers, 0, len(buffers))
    return Packed(plan=p, pool=pool, buffers=buffers, buckets=metas)


def send_packed(tx: TrainerTransfer, packed: Packed) -> None:
    """Send every packed bucket in order, at most two in flight; returns when all are sent."""
    send_all(tx, packed.buffers)


def send_all(tx: TrainerTransfer, buffers: Sequence[torch.Tensor]) -> None:
    """Send ready byte buffers in order, at most two in flight; returns when all are sent."""
    window: list[Handle] = []
    for buf in buffers:
        if len(window) == 2:
            window.pop(0).wait()
        window.append(tx.send(buf))
    for h in window:
        h.wait()


def send_buckets(tx: TrainerTransfer, p: Plan, named: Named | Mapping[str, torch.Tensor],
                 *, scratch: list[torch.Tensor] | None = None) -> None:
    """Pass two of pack-twice: pack bucket ``k+1`` while bucket ``k`` is on the wire.

    ``scratch``: two reusable buffers of at least ``p.max_bucket`` bytes.
    """
    lookup = _lookup(named)
    bufs = scratch if scratch and len(scratch) >= 2 and min(b.numel() for b in scratch) >= p.max_bucket \
        else alloc_buffers(p.max_bucket)
    inflight: list[Handle | None] = [None, None]
    for k, size in enumerate(p.bucket_sizes):
        slot = k % 2
        if inflight[slot] is not None:
            inflight[slot].wait()  # type: ignore[union-attr]
        out = bufs[slot][:size]
        pack(k, p.per_bucket[k], lookup, out)
        inflight[slot] = tx.send(out)
    for h in inflight:
        if h is not None:
            h.wait()


Landing = Callable[[BucketMeta, Sequence[ParamMeta]], "torch.Tensor | None"]


def recv_buckets(rx: WorkerTransfer, params: Sequence[ParamMeta], buckets: Sequence[BucketMeta], sink: Sink,
                 *, scratch: list[torch.Tensor] | None = None, landing: Landing | None = None) -> None:
    """Receive every bucket, verify its checksum, and call ``sink(name, view)`` per tensor.

    ``view`` aliases a reused receive buffer: the sink must copy it before returning —
    unless ``landing(bucket, metas)`` gave a buffer of its own for that bucket (exactly
    ``bucket.nbytes`` of contiguous uint8, e.g. the tensor's final memory): then the bytes
    are received straight into it and the views alias it.
    A bucket whose checksum does not match is not passed to the sink; the remaining
    buckets are still received (so the group stays in step with the trainer) and
    ChecksumMismatch is raised at the end, naming the first bad bucket. Validate the
    metadata (:func:`rlbus.transfer.buckets.validate`) before acknowledging the
    update: a PlanError raised here leaves the trainer's sends unanswered until
    they time out.
    """
    validate(params, buckets)
    per_bucket = by_bucket(params, len(buckets))
    biggest = max((b.nbytes for b in buckets), default=0)
    if not buckets:
        return
    bufs: list[torch.Tensor] = []

    def scratch_for(k: int) -> torch.Tensor:
        # allocated (and pre-touched) only once a bucket has no landing buffer of its own
        if not bufs:
            usable = scratch and len(scratch) >= 2 and min(b.numel() for b in scratch) >= biggest
            bufs.extend(scratch if usable else alloc_buffers(biggest))  # type: ignore[arg-type]
        return bufs[k % 2][: buckets[k].nbytes]
    bad: list[tuple[int, str, str]] = []

    def dest(k: int) -> torch.Tensor:
        # a landing buffer (the tensor's final memory) saves the copy out of scratch
        got = landing(buckets[k], per_bucket[k]) if landing is not None else None
        if got is not None and got.numel() == buckets[k].nbytes and got.dtype == torch.uint8 and got.is_contiguous():
            return got
        return scratch_for(k)

    buf_next = dest(0)
    pending = rx.recv(buf_next)
    for k, meta in enumerate(buckets):
        pending.wait()
        buf = buf_next
        if k + 1 < len(buckets):
            buf_next = dest(k + 1)
            pending = rx.recv(buf_next)
        got = checksum(buf)
        if got != meta.checksum:
            bad.append((k, meta.checksum, got))
            continue
        for name, view in unpack(buf, per_bucket[k]):
            sink(name, view)
    if bad:
        k, expected, got = bad[0]
        raise ChecksumMismatch(k, expected, got, others=tuple(b[0] for b in bad[1:]))


def _lookup(named: Named | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(named, Mapping):
        return named
    lookup = dict(named)
    if len(lookup) != len(named):
        raise PlanError("tensor names must be unique")
    return lookup
