"""The hot path: named tensors -> checksummed buckets -> the wire -> a sink, on both sides.

Workers check names, dtypes and shapes from the metadata before any byte moves; the
checksums need not be known by then, so the trainer computes each one just before its
bucket leaves and hands the list on afterwards (the SDK sends it with
``finish_weight_update``, through the authenticated control plane, and every worker
compares it with what it hashed before it reports "staged and verified"):

* :func:`send_stream` — the default: bucket ``k+1`` is packed and hashed while bucket
  ``k`` is on the wire (up to SEND_DEPTH in flight), in two reusable scratch buffers, so the
  trainer reads each byte of the model once to pack and once to hash, holds two buckets
  of extra memory, and sends its first byte after hashing one bucket, not the model.
  A bucket that is exactly one contiguous tensor is sent from the tensor itself.
* :func:`pack_all` then :func:`send_all` — pack and hash every bucket once into one pool
  and send it (again and again if need be): for weights sent more than once.

The receiver hashes bucket ``k`` and hands its tensors to the sink while bucket ``k+1``
arrives, and returns the checksums it computed (or checks them against ``expected``).

Everything happens on the group's device (:func:`transfer_device`): over NCCL the trainer's
scratch buckets are GPU memory, GPU tensors are packed into them (or sent from their own
memory), hashed there with the device checksum and broadcast; workers receive into GPU
buffers (or straight into a live parameter), hash there and hand device views to the sink.
The same code runs with the host as the device for gloo and shm.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from rlbus.schemas import BucketMeta, ParamMeta
from rlbus.transfer.base import (
    ChecksumMismatch,
    Handle,
    PlanError,
    SharedMemoryTrainer,
    SharedMemoryWorker,
    TrainerTransfer,
    ViewHandle,
    WorkerTransfer,
)
from rlbus.transfer.buckets import align_up, by_bucket, copy_out, default_solo_bytes, pack, plan, unpack, validate
from rlbus.transfer.checksum import ChecksumKind, checksum, checksum_kind

DEFAULT_BUCKET_BYTES = 64 << 20
SEND_DEPTH = 8
"""Buckets the trainer keeps in flight at once. Those packed into scratch take one of its two
scratch buffers and wait for it; those sent from their tensors' own memory cost no memory in
flight. Eight, not two: 1 GiB as 4 MiB buckets over gloo, hashed on both ends (a scratch
script, best of five, R = 1/2/3): 329 / 596 / 892 ms as sends with eight in flight, 365 / 631 /
863 as broadcasts with eight, 390 / 697 / 944 as broadcasts with two (16 MiB broadcasts with
two: 360 / 574 / 812)."""
Named = Sequence[tuple[str, torch.Tensor]]
Sink = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class Plan:
    """Where every tensor goes: its ParamMeta and the size of every bucket."""

    params: list[ParamMeta]
    bucket_sizes: list[int]
    per_bucket: list[list[ParamMeta]] = field(repr=False)

    @property
    def buckets(self) -> list[BucketMeta]:
        """The bucket list of the metadata (``UpdateWeights.buckets``)."""
        return [BucketMeta(index=k, nbytes=n) for k, n in enumerate(self.bucket_sizes)]

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
    checksums: list[str]


def prepare(
    named: Named,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    max_tensors: int | None = None,
    solo_bytes: int | None = None,
) -> Plan:
    """Plan the buckets for ``named`` (input order, 64-byte aligned); ``max_tensors`` caps
    the tensors of one shared bucket (so its metadata fits one control message); a tensor of
    at least ``solo_bytes`` travels alone (:func:`solo_bytes` gives a transport's; by default
    a quarter of a bucket)."""
    params, sizes = plan(named, bucket_bytes, max_tensors, solo_bytes)
    return Plan(params=params, bucket_sizes=sizes, per_bucket=by_bucket(params, len(sizes)))


def alloc_buffers(nbytes: int, count: int = 2, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """``count`` uint8 buffers of ``nbytes`` on ``device``, pages already touched (zeroed)."""
    return [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]


def transfer_device(transfer: object) -> torch.device:
    """Where a transfer's group moves bytes from and to (its ``device``: CUDA for nccl, the host
    for gloo and shm): buckets are packed, hashed and received there, so nothing crosses
    PCIe but what a caller's own buffer asks for (a host landing buffer over NCCL: staging)."""
    return torch.device(getattr(transfer, "device", "cpu"))


def sole_tensor_bytes(
    metas: Sequence[ParamMeta], size: int, tensors: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """The bytes of a bucket that is exactly one contiguous tensor, as a uint8 view of that
    tensor's own memory, on whatever device it lives (None otherwise). The trainer sends such a
    bucket from the tensor itself; an in_place worker receives it straight into its live
    parameter (a transport stages it only if it lives off the group's device)."""
    if len(metas) != 1 or metas[0].offset != 0 or metas[0].nbytes != size or metas[0].encoding != "dense":
        return None
    t = tensors.get(metas[0].name)
    if t is None or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def scratch_bytes(p: Plan, named: Named | Mapping[str, torch.Tensor], *, pack_every_bucket: bool = False) -> int:
    """The size each of :func:`send_stream`'s two scratch buffers needs for this plan."""
    lookup = _lookup(named)
    return max(
        (
            size
            for k, size in enumerate(p.bucket_sizes)
            if pack_every_bucket or sole_tensor_bytes(p.per_bucket[k], size, lookup) is None
        ),
        default=0,
    )


def packs_every_bucket(tx: TrainerTransfer) -> bool:
    """Whether :func:`send_stream` should pack every bucket into its scratch buffers for
    ``tx`` (its ``pack_every_bucket``, and :func:`scratch_bytes`'s): true when the scratch
    buffers live in memory workers read (a :class:`SharedMemoryTrainer`), so that no bucket
    is sent from a tensor's private memory."""
    return isinstance(tx, SharedMemoryTrainer)


SEND_SOLO_BYTES = 1 << 20
"""Over a transport that moves every bucket as its own point-to-point send (gloo's default,
see ``TorchDistTrainer.broadcasts``) a tensor of at least this many bytes travels alone, even
in a bigger bucket: such a send costs little more than its bytes (it starts on the caller's
thread, eight in flight), while packing copies the tensor on the trainer and again on every
receiver. bench/push.py --model mixed (200 tensors, 16 MiB buckets: 13 % of the bytes packed
with a quarter, 3 % with 1 MiB), 2026-12-06, six runs against four, partly alternated: R = 1
update 394-475 ms (median 438) against 429-481 (457), rlbus/bare 0.85-0.96 against 0.80-0.87;
R = 3 best 994 against 1039 ms; R = 2 the same."""


def solo_bytes(tx: TrainerTransfer, bucket_bytes: int) -> int:
    """The ``solo_bytes`` to plan with for ``tx``: :data:`SEND_SOLO_BYTES` (or a quarter of a
    bucket, if smaller) when it sends each bucket point to point, else a quarter of a bucket,
    where packing small tensors saves a collective (a broadcast's cost does not shrink with
    its bytes) or a copy is due anyway (shm packs every bucket)."""
    quarter = default_solo_bytes(bucket_bytes)
    if getattr(tx, "broadcasts", True) or packs_every_bucket(tx):
        return quarter
    return min(quarter, SEND_SOLO_BYTES)


def prepare_for(tx: TrainerTransfer, named: Named, bucket_bytes: int, max_tensors: int | None = None) -> Plan:
    """:func:`prepare` for sending over ``tx``: a tensor travels alone from :func:`solo_bytes`."""
    return prepare(named, bucket_bytes, max_tensors, solo_bytes(tx, bucket_bytes))


def scratch_pair(tx: TrainerTransfer, need: int) -> list[torch.Tensor]:
    """Two reusable packing buffers of ``need`` bytes each for :func:`send_stream` over ``tx``
    (``need``: :func:`scratch_bytes` with ``pack_every_bucket=packs_every_bucket(tx)``).

    From ``tx.alloc`` when ``tx`` is a :class:`SharedMemoryTrainer` (workers then copy
    straight out of them; they live until ``tx.close()``), else on the group's device
    (:func:`transfer_device`: GPU memory for nccl, where the tensors are packed and hashed).
    """
    if isinstance(tx, SharedMemoryTrainer):
        pair = tx.alloc(2 * need)
    else:
        pair = torch.empty(2 * need, dtype=torch.uint8, device=transfer_device(tx))
    return [pair[:need], pair[need:]]


def send_stream(
    tx: TrainerTransfer,
    p: Plan,
    named: Named | Mapping[str, torch.Tensor],
    *,
    first: int = 0,
    last: int | None = None,
    scratch: Sequence[torch.Tensor] | None = None,
    pack_every_bucket: bool = False,
    hash_buckets: bool = True,
) -> list[str]:
    """Send buckets ``first..last-1`` of the plan; returns their checksums, in order (none
    with ``hash_buckets=False``: the receivers check the tensors another way, e.g. a repair
    against the commit's manifest).

    Bucket ``k+1`` is packed (into one of two scratch buffers) and hashed while bucket
    ``k`` is on the wire; at most SEND_DEPTH buckets are in flight, two of them packed. ``scratch``: two buffers of
    at least :func:`scratch_bytes` each (allocated here if missing or too small); for the
    shm backend, buffers from ``tx.alloc`` that workers copy straight out of, with
    ``pack_every_bucket`` so that no bucket is sent from the tensor's private memory
    (:func:`scratch_pair` and :func:`packs_every_bucket` choose both for any ``tx``).
    The tensors must not change until this returns.
    """
    lookup = _lookup(named)
    kind = group_checksum_kind(tx)
    last = len(p.bucket_sizes) if last is None else last
    if not 0 <= first <= last <= len(p.bucket_sizes):
        raise PlanError(f"bucket range {first}..{last} outside the plan's {len(p.bucket_sizes)} buckets")
    if first == last:
        return []
    need = scratch_bytes(p, lookup, pack_every_bucket=pack_every_bucket)
    if scratch is None or len(scratch) < 2 or min(b.numel() for b in scratch[:2]) < need:
        scratch = alloc_buffers(need, device=transfer_device(tx))
    dev = transfer_device(tx)
    slot, slot_sent = 0, [None, None]  # the send that last used each scratch buffer
    window: list[tuple[Handle, torch.Tensor]] = []  # each send with the bytes it must keep alive
    sums: list[str] = []
    for k in range(first, last):
        size = p.bucket_sizes[k]
        buf = None if pack_every_bucket else sole_tensor_bytes(p.per_bucket[k], size, lookup)
        packed = buf is None
        if packed:
            if slot_sent[slot] is not None:
                slot_sent[slot].wait()  # type: ignore[attr-defined, union-attr]
            buf = pack(k, p.per_bucket[k], lookup, scratch[slot][:size])
        elif buf.device != dev:  # type: ignore[union-attr]
            buf = buf.to(dev)  # type: ignore[union-attr]  # staged: hashed and sent from the group's device
        if hash_buckets:
            sums.append(checksum(buf, kind, seed=k - first))  # type: ignore[arg-type]
        if len(window) == SEND_DEPTH:
            window.pop(0)[0].wait()
        window.append((tx.send(buf), buf))  # type: ignore[arg-type]
        if packed:
            slot_sent[slot], slot = window[-1][0], 1 - slot  # type: ignore[call-overload]
    for h, _ in window:
        h.wait()
    return sums


def pack_all(
    p: Plan,
    named: Named | Mapping[str, torch.Tensor],
    *,
    pool: torch.Tensor | None = None,
    kind: ChecksumKind | None = None,
    device: torch.device | str = "cpu",
) -> Packed:
    """Pack every bucket once into a pool (reused when big enough; else allocated on ``device``,
    the group's) and hash it (``kind``: the group's algorithm, :func:`group_checksum_kind`;
    None: the default)."""
    lookup = _lookup(named)
    offsets, end = [], 0
    for size in p.bucket_sizes:
        offsets.append(end)
        end = align_up(end + size)
    if pool is None or pool.numel() < end:
        pool = torch.empty(end, dtype=torch.uint8, device=device)
    buffers = [
        pack(k, p.per_bucket[k], lookup, pool[off : off + size])
        for k, (off, size) in enumerate(zip(offsets, p.bucket_sizes))
    ]
    return Packed(
        plan=p, pool=pool, buffers=buffers, checksums=[checksum(b, kind, seed=k) for k, b in enumerate(buffers)]
    )


def send_all(tx: TrainerTransfer, buffers: Sequence[torch.Tensor]) -> None:
    """Send ready byte buffers in order, at most SEND_DEPTH in flight; returns when all are sent."""
    window: list[Handle] = []
    for buf in buffers:
        if len(window) == SEND_DEPTH:
            window.pop(0).wait()
        window.append(tx.send(buf))
    for h in window:
        h.wait()


Landing = Callable[[BucketMeta, Sequence[ParamMeta]], "torch.Tensor | None"]
_Posted = tuple["torch.Tensor | None", "torch.Tensor | None", "Handle | ViewHandle", "torch.Tensor | None"]
"""A receive in flight: where it lands (None: a view), the landing buffer to fill after it, its
handle, and the scratch buffer it took (None: none)."""

RECV_DEPTH = SEND_DEPTH
"""Receives a worker keeps posted at once (over shm, one: a view is no wire). gloo sends a
bucket's bytes only once the receiver has posted its receive; with one posted, the wire stood
idle between buckets while the worker woke up and posted the next (1 GiB in 4 MiB broadcasts at
R = 1: 501 -> 472 ms with two posted). Buckets that land in their own memory (a live parameter,
a staged copy) are posted up to this many ahead; those received into scratch, to be copied out,
take one of two scratch buffers, and wait for one to be copied out."""


def recv_buckets(
    rx: WorkerTransfer,
    params: Sequence[ParamMeta],
    buckets: Sequence[BucketMeta],
    sink: Sink,
    *,
    scratch: list[torch.Tensor] | None = None,
    landing: Landing | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    expected: Sequence[str] | None = None,
    hash_buckets: bool = True,
) -> list[str]:
    """Receive every bucket, hash it, and call ``sink(name, view)`` per tensor; returns the
    checksums it computed, in order (none with ``hash_buckets=False``: the caller checks the
    tensors some other way, e.g. a repair against the commit's manifest).

    The sink sees bytes before they are verified: treat them as provisional until the
    checksums were compared (staged: keep them aside; in place: the parameter is dirty
    until the update commits). ``view`` aliases a reused receive buffer (or, over shm, the
    trainer's shared memory, which it reuses), so the sink must copy it before returning —
    unless ``landing(bucket, metas)`` gave a buffer of its own
    for that bucket (exactly ``bucket.nbytes`` of contiguous uint8, e.g. the tensor's final
    memory): then the bytes are received straight into it and the views alias it; or
    ``into`` (the destination tensors, by name) has the tensor: then its bytes are already
    copied there and ``view`` is ``into[name]`` itself (see :func:`copy_out`).
    ``scratch``: the two receive buffers of a bucket that has no landing buffer, kept by the
    caller from one receive to the next: used when both are big enough, else replaced in the
    list by new ones (a delta push's worker receives once per group: allocating and
    pre-touching 2 x 16 MiB each time cost it ~25 ms of CPU a 1 GiB push, sampled).
    ``expected``: the trainer's checksums, if already known; every bucket is received and
    then ChecksumMismatch is raised naming the first bad one (see :func:`verify`).
    Validate the metadata (:func:`rlbus.transfer.buckets.validate`) before acknowledging
    the update: a PlanError raised here leaves the trainer's sends unanswered until they
    time out.
    """
    validate(params, buckets)
    kind = group_checksum_kind(rx)
    per_bucket = by_bucket(params, len(buckets))
    biggest = max((b.nbytes for b in buckets), default=0)
    sums: list[str] = []
    if not buckets:
        return sums
    free: list[torch.Tensor] = []  # the scratch buffers no posted bucket holds
    allocated = False

    def allocate_scratch() -> None:
        # only once a bucket has no landing buffer of its own (pre-touched when new)
        nonlocal allocated
        usable = scratch and len(scratch) >= 2 and min(b.numel() for b in scratch) >= biggest
        if usable:
            free.extend(scratch[:2])  # type: ignore[index]
        else:
            fresh = alloc_buffers(biggest, device=transfer_device(rx))
            if scratch is not None:  # the caller keeps them for its next receive
                scratch[:] = fresh
            free.extend(fresh)
        allocated = True

    shared = rx if isinstance(rx, SharedMemoryWorker) else None
    dev = transfer_device(rx)
    lands: dict[int, torch.Tensor | None] = {}  # a bucket's landing buffer, asked for once

    def landing_of(k: int) -> torch.Tensor | None:
        if k not in lands:
            got = landing(buckets[k], per_bucket[k]) if landing is not None else None
            if got is not None and not (
                got.numel() == buckets[k].nbytes and got.dtype == torch.uint8 and got.is_contiguous()
            ):
                got = None
            lands[k] = got
        return lands[k]

    def needs_scratch(k: int) -> bool:
        got = landing_of(k)
        return shared is None and not (got is not None and got.device == dev)

    def post(k: int) -> _Posted:
        """Start receiving bucket k: into its landing buffer (the tensor's final memory) if
        it has one on the group's device, else as a view where the transport holds it (shm: no
        copy at all; None), else into a free scratch buffer, to be copied out. A landing buffer
        elsewhere (a host copy over NCCL) is filled once the bucket was hashed on the group's
        device. The last item: the scratch buffer taken, to be freed once copied out."""
        got = lands.pop(k)
        if got is not None and got.device == dev:
            return got, None, rx.recv(got), None
        if shared is not None:
            return None, got, shared.recv_view(buckets[k].nbytes), None
        whole = free.pop()
        buf = whole[: buckets[k].nbytes]
        return buf, got, rx.recv(buf), whole

    depth = 1 if shared is not None else RECV_DEPTH
    posted: deque[_Posted] = deque()
    following = 0  # the next bucket to post

    def post_ahead() -> None:
        """Post the next buckets in order, up to ``depth`` at once, while each finds its memory
        (a bucket that needs scratch waits for one of the two buffers to be copied out)."""
        nonlocal following
        while following < len(buckets) and len(posted) < depth:
            if needs_scratch(following):
                if not allocated:
                    allocate_scratch()
                if not free:
                    return
            posted.append(post(following))
            following += 1

    post_ahead()
    for k in range(len(buckets)):
        into_buf, land, pending, taken = posted.popleft()
        view = pending.wait()
        post_ahead()  # over shm one at a time: a posted view holds a trainer's slot
        buf = into_buf if into_buf is not None else view
        assert buf is not None
        if hash_buckets:
            sums.append(checksum(buf, kind, seed=k))
        if land is not None:  # hashed where it arrived, then landed where the caller keeps it
            land.copy_(buf)
            buf = land
        copied = into is not None and land is None and (view is not None or taken is not None)
        for name, tensor in copy_out(buf, per_bucket[k], into) if copied else unpack(buf, per_bucket[k]):  # type: ignore[arg-type]
            sink(name, tensor)
        if into_buf is None:  # a view where the transport holds it: known from how it was posted
            cast(ViewHandle, pending).release()  # (isinstance against the protocol: ~20 us a bucket)
        if taken is not None:
            free.append(taken)  # copied out: the next bucket that needs scratch may take it
            post_ahead()
    if expected is not None:
        verify(sums, expected)
    return sums


def group_checksum_kind(transfer: object) -> ChecksumKind:
    """The checksum algorithm of a transfer's group: its ``checksum_kind`` (every rlbus backend
    has one, chosen from its backend and ``RLBUS_CHECKSUM``), else the default."""
    return getattr(transfer, "checksum_kind", None) or checksum_kind()


def verify(got: Sequence[str], expected: Sequence[str]) -> None:
    """ChecksumMismatch unless the received buckets' checksums are exactly the trainer's."""
    bad = [k for k, (g, e) in enumerate(zip(got, expected)) if g != e]
    if len(got) != len(expected):
        raise ChecksumMismatch(
            min(len(got), len(expected)),
            "",
            "",
            detail=(f"checksum count: {len(got)} buckets were received, the trainer's checksums cover {len(expected)}"),
        )
    if bad:
        raise ChecksumMismatch(bad[0], expected[bad[0]], got[bad[0]], others=tuple(bad[1:]))


def _lookup(named: Named | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(named, Mapping):
        return named
    lookup = dict(named)
    if len(lookup) != len(named):
        raise PlanError("tensor names must be unique")
    return lookup
