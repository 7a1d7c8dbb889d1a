"""The trainer's side of an update session: WeightPush owns the transfer group (rank 0), the
workers it was built for, the two packing buffers and the checksums of the open session.
RLClient (client.py) delegates its update calls here.

Delta sessions (`start(..., delta=True)`): WeightPush keeps the last committed bits of what it
sent (snapshot.py) and sends, per tensor, only the elements whose bits changed since then,
against that commit's sequence number; a fleet that does not hold exactly that commit refuses,
and the session opens dense instead (PushStats.fallback says why)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import msgspec

from rlbus.schemas import (
    MAX_COMMAND_BYTES,
    Aborted,
    AbortWeightUpdate,
    AnyControlCommand,
    Backend,
    DeadlineExceeded,
    FailedPrecondition,
    FinishWeightUpdate,
    FleetAck,
    InitWeightTransfer,
    InvalidArgument,
    ParamMeta,
    RLBusError,
    ServerInfo,
    StartWeightUpdate,
    TensorChecksum,
    TransferInit,
    Unavailable,
    UpdateTarget,
    UpdateWeights,
    encode,
)

if TYPE_CHECKING:
    import torch

    from rlbus.sdk.snapshot import Committed, Pending
    from rlbus.transfer.base import TrainerTransfer

log = logging.getLogger("rlbus.sdk.push")
T = TypeVar("T")

# Buckets sized to the transport: gloo pipelines best around 16 MiB; shm pays store round
# trips per bucket and copies straight out of the pool, so larger buckets win (bench/transfer.py,
# vs memcpy: 16 MiB 0.5-0.8x with one receiver; 64 MiB ~0.95x with one, 0.6-0.75x with two;
# 128 MiB 0.8-0.97x with one, 0.76-0.88x with two); nccl amortises its launches.
BUCKET_BYTES: dict[str, int] = {"gloo": 16 << 20, "shm": 128 << 20, "nccl": 256 << 20}

META_HEADROOM = 4096
"""Bytes of a metadata message kept for what the controller adds when it forwards it to the
workers (session id, epoch, command id)."""

PARAM_META_BOUND = 160
"""An upper bound of one ParamMeta's encoded size beside its name and shape."""

DELTA_META_BOUND = 96
"""What a delta's fields (encoding, index, changed, index_nbytes, values_offset) add to it."""

DELTA_GROUPS = 8
"""A delta update is compared and encoded in up to this many groups of tensors, the next while
the last travels (each group one more UpdateWeights round trip). The last group is written and
hashed by the workers after the trainer is done, so smaller groups shorten the finish:
bench/delta.py at R = 1 (1 GiB, 2026-12-06, five runs against four, partly alternated): the
finish 17-20 ms against 30-41 with 4 groups, the delta 326-341 ms (median 330) against
332-469 (median 346), the encode the same (281-300 ms). 16 groups encode slower (336-440 ms:
each group's threads start and finish on their own). On 2026-12-04, before the faster compare,
8 measured slower than 4 in one run each."""

DELTA_GROUP_MIN_BYTES = 64 << 20
"""A group holds at least this many bytes (dense) of tensors: smaller models go in fewer."""


class PushStats(msgspec.Struct, kw_only=True):
    """What one update session sent (`RLClient.last_push`)."""

    target: UpdateTarget = "main"
    delta: bool = False
    """The session carried deltas against `base_seq` (else every tensor went dense)."""
    base_seq: int | None = None
    fallback: str | None = None
    """A delta was asked for and the fleet refused its base: why (the session went dense)."""
    committed: bool = False
    tensors: int = 0
    tensors_delta: int = 0
    tensors_dense: int = 0
    tensors_unchanged: int = 0
    """Bit-identical to the base: not sent at all."""
    elements: int = 0
    compared: int = 0
    """Elements compared against the base (tensors the snapshot had)."""
    changed: int = 0
    """Of those, how many differ in their bits."""
    bytes_sent: int = 0
    """Bytes on the wire (every bucket, deltas and dense tensors)."""
    bytes_dense: int = 0
    """What the same tensors take dense."""
    encode_s: float = 0.0
    """Trainer time spent comparing against the base and encoding."""

    @property
    def changed_fraction(self) -> float | None:
        """Changed elements over compared ones (None: nothing compared)."""
        return self.changed / self.compared if self.compared else None

    @property
    def byte_ratio(self) -> float:
        """bytes_sent / bytes_dense (1.0 for a dense session)."""
        return self.bytes_sent / self.bytes_dense if self.bytes_dense else 1.0


class Call(Protocol):
    """RLClient's request to the controller: a typed reply or the exception for its code."""

    def __call__(self, command: AnyControlCommand, expect: type[T], timeout: float | None = None) -> Awaitable[T]: ...


class WeightPush:
    """One per client. Not safe for two sessions at once: the controller refuses a second one."""

    def __init__(self, call: Call, max_payload: Callable[[], int]) -> None:
        self._call = call
        self._max_payload = max_payload
        """The NATS server's limit on one message (read from the connection)."""
        self.transfer: TrainerTransfer | None = None
        """The trainer's side of the group (rank 0); None until init_weight_transfer()."""
        self.init: TransferInit | None = None
        self.group: list[str] = []
        """Worker ids (rank order) the group was built for."""
        self.scratch: list[torch.Tensor] = []
        """The two packing buffers, reused every step (over shm: the transport's shared memory)."""
        self._scratch_of: object = None
        self.checksums: list[str] = []
        """Every bucket sent in the open session, in order: what finish carries to the workers."""
        self.session_id: str | None = None
        """The session this client opened: its updates, finish and abort name it, so they
        never land in another trainer's session."""
        self.bucket_bytes: int | None = None
        """Bucket size (None: sized to the transport, see BUCKET_BYTES)."""
        self.committed: dict[str, Committed] = {}
        """Per target: the committed bits of every tensor sent in tracked (delta=True) sessions."""
        self.pending: Pending | None = None
        """The open tracked session's record, swapped into `committed` only at a successful finish."""
        self.tensor_checksums: list[TensorChecksum] = []
        """The open session's checksums of full resulting tensors (of those sent as deltas)."""
        self.stats: PushStats = PushStats()
        """The open (or last) session's counts."""
        self.last: PushStats | None = None
        """The last session that finished or failed."""
        self._target: UpdateTarget = "main"
        self.encode_threads = min(4, os.cpu_count() or 1)
        """Threads that compare tensors against the committed bits in a delta session."""
        self._compares: tuple[int, ThreadPoolExecutor] | None = None
        """The compare threads (how many, the pool), kept from group to group and push to push
        (not tied to the transfer group: idle, they cost nothing; they end when the client closes)."""

    @property
    def ready(self) -> bool:
        """True once a group was built and not torn down since."""
        return self.transfer is not None

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        self.transfer = self.init = None
        self.scratch, self._scratch_of = [], None

    def end_compares(self) -> None:
        """Let the kept compare threads end (the client closes; a later push starts new ones)."""
        if self._compares is not None:
            self._compares[1].shutdown(wait=False)
            self._compares = None

    def _compare_pool(self) -> ThreadPoolExecutor:
        """`encode_threads` compare threads, started once and kept for every group of every push
        (started again only when `encode_threads` changed). Measured (2026-12-07, 1 GiB bf16 in
        8 groups, two threads, six alternated runs): the encode alone 188 against 200 ms with
        threads started afresh per group (CPU 300 against 314 ms); inside bench/delta.py's push
        no difference shows through its noise."""
        if self._compares is None or self._compares[0] != self.encode_threads:
            self.end_compares()
            pool = ThreadPoolExecutor(self.encode_threads, thread_name_prefix="rlbus-delta")
            self._compares = (self.encode_threads, pool)
        return self._compares[1]

    async def init_transfer(
        self, info: ServerInfo, backend: Backend | None, master_addr: str | None, timeout_s: float
    ) -> FleetAck:
        """Open rank 0 of a new group while every worker in `info` joins it."""
        from rlbus.transfer.base import TransferError, detached
        from rlbus.transfer.factory import trainer_transfer

        master_addr = master_addr or os.environ.get("RLBUS_MASTER_ADDR", "127.0.0.1")
        chosen = backend or info.capabilities.weight_transfer_backend
        backends = {w.worker_id: w.capabilities.weight_transfer_backend for w in info.workers}
        if not info.workers:
            raise Unavailable("no workers are registered")
        if chosen is None or any(b != chosen for b in backends.values()):
            # refuse here, before a rendezvous thread would wait for ranks that never come
            raise FailedPrecondition(f"workers have no common weight transfer backend {chosen or ''}: {backends}")
        if info.session_id:
            raise FailedPrecondition(f"session {info.session_id} is open; finish or abort it first")
        self.close()
        tx = trainer_transfer(chosen)
        init = tx.bind(
            TransferInit(
                backend=chosen,
                master_addr=master_addr,
                master_port=0,
                world_size=1 + sum(w.capabilities.transfer_ranks for w in info.workers),
                rank_offset=1,
                group_name=f"rlbus-{uuid.uuid4().hex[:12]}",
                timeout_s=timeout_s,
            )
        )
        opened = anyio.Event()
        failure: list[BaseException] = []

        async def open_side() -> None:
            try:
                await detached(tx.open, init, name="rlbus-open")
            except BaseException as e:
                failure.append(e)
            opened.set()

        refused: list[RLBusError] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(open_side)
                try:
                    ack = await self._call(InitWeightTransfer(backend=chosen, init_info=init), FleetAck)
                except RLBusError as e:
                    refused.append(e)
                    tg.cancel_scope.cancel()  # the open side would only time out
                else:
                    await opened.wait()
        except BaseException:
            tx.close()
            raise
        if refused:
            tx.close()
            raise refused[0]
        if failure:
            tx.close()
            cause = failure[0]
            if isinstance(cause, TransferError):
                raise DeadlineExceeded(f"weight-transfer group did not form: {cause}") from None
            raise cause
        self.transfer, self.init = tx, init
        self.group = [w.worker_id for w in ack.workers]
        return ack

    async def start(self, target: UpdateTarget, delta: bool = False) -> FleetAck:
        """Open a session. delta: send deltas against the last commit this client tracked,
        if there is one and every worker holds exactly it; otherwise the session is dense
        (a refusal's message is kept in stats.fallback) and tracks what it sends."""
        base = self.committed.get(target) if delta else None
        fallback: str | None = None
        if base is not None and base.broken:  # the trainer's copy is not the committed bits: dense heals it
            fallback, base = base.broken, None
            self.committed.pop(target, None)
        ack: FleetAck | None = None
        if base is not None:
            try:
                ack = await self._call(StartWeightUpdate(target=target, base_seq=base.seq), FleetAck)
            except FailedPrecondition as e:  # not on the base (or anything else: the dense start says)
                fallback = e.message
                log.warning("delta push refused (%s); pushing dense weights to the fleet instead", e.message)
                base = None
        if ack is None:
            ack = await self._call(StartWeightUpdate(target=target), FleetAck)
        assert ack is not None
        self.checksums, self.session_id = [], ack.session_id
        self.tensor_checksums = []
        self._target = target
        if delta:
            from rlbus.sdk.snapshot import Pending

            self.pending = Pending(base_seq=base.seq if base is not None else None)
        else:
            self.pending = None
        self.stats = PushStats(
            target=target, delta=base is not None, base_seq=base.seq if base else None, fallback=fallback
        )
        return ack

    def _encode(self, named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """What travels for each tensor of a tracked session: its delta's bytes, nothing (not
        changed), or the tensor itself; records each in `pending`. Runs in a thread; the
        compares run on `encode_threads` threads (numpy and torch release the GIL)."""
        from rlbus.sdk.snapshot import committed_copy
        from rlbus.transfer import delta as D
        from rlbus.transfer.checksum import checksum_kind

        pending, st = self.pending, self.stats
        assert pending is not None
        base = self.committed.get(self._target) if pending.base_seq is not None else None
        kind = checksum_kind(self.init.backend if self.init else None)  # the workers hash results alike
        t0 = time.perf_counter()
        olds: list[torch.Tensor | None] = []
        for name, t in named:
            again = name in pending.deltas or name in pending.dense
            if again:  # sent twice in a session: the second goes dense (the first's delta is void)
                pending.deltas.pop(name, None)
                self.tensor_checksums = [c for c in self.tensor_checksums if c.name != name]
            old = base.tensors.get(name) if base is not None and not again else None
            olds.append(old if old is not None and old.dtype == t.dtype and old.shape == t.shape else None)

        def compare(part: list[int]) -> list[tuple[int, Any, str]]:
            # compared where the tensor lives (a GPU tensor on its GPU, against a base there or in
            # pinned host memory); on the host in one compiled call for the part, each result's
            # checksum taken in the compare's pass and the last commit's delta written in it
            items = []
            for k in part:
                old = olds[k]
                assert old is not None
                items.append((named[k][1], old, base.take(named[k][0]) if base is not None else None))
            return D.diff_many(items, kind)

        todo = [k for k in range(len(named)) if olds[k] is not None]
        threads = max(1, min(self.encode_threads, len(todo)))
        runs = byte_runs([named[k][1] for k in todo], threads * PARTS_PER_THREAD if threads > 1 else 1)
        parts = [[todo[i] for i in run] for run in runs]
        found: list[tuple[int, Any, str] | None] = [None] * len(named)
        done = self._compare_pool().map(compare, parts) if threads > 1 else map(compare, parts)
        for part, results in zip(parts, done):
            for k, r in zip(part, results):
                found[k] = r
        sending: list[tuple[str, torch.Tensor]] = []
        deltas: dict[str, Any] = {}
        for (name, t), got in zip(named, found):
            numel = t.numel()
            st.tensors += 1
            st.elements += numel
            st.bytes_dense += numel * t.element_size()
            if got is not None:
                changed, d, digest = got
                st.compared += numel
                st.changed += changed
                if changed == 0:
                    st.tensors_unchanged += 1
                    continue
                if d is not None:
                    pending.deltas[name] = d
                    self.tensor_checksums.append(TensorChecksum(name=name, checksum=digest))
                    sending.append((name, d.blob))
                    deltas[name] = d
                    st.tensors_delta += 1
                    continue
            pending.dense[name] = committed_copy(t)
            sending.append((name, t))
            st.tensors_dense += 1
        st.encode_s += time.perf_counter() - t0
        return sending, deltas

    async def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int | None) -> FleetAck:
        """Metadata through the controller (every worker checks names, dtypes and shapes
        first), then the bytes out-of-band in checksummed buckets, each packed and hashed
        while the one before it is on the wire. A delta session compares and encodes the
        tensors in up to DELTA_GROUPS groups, the next group while the last one's metadata and
        buckets travel (and the workers write and hash it)."""
        import asyncio

        from rlbus.transfer.base import detached

        if self.transfer is None:
            raise FailedPrecondition("no weight-transfer group; call init_weight_transfer() first")
        # Tensors stay where they are: packed (or sent from their own memory) and hashed on the
        # group's device (GPU memory for nccl), and no host copy is made beside the two scratch buckets.
        named = [(n, t.detach()) for n, t in named_tensors]
        size = bucket_bytes or self.bucket_bytes or BUCKET_BYTES[self.init.backend if self.init else "gloo"]
        limit = min(self._max_payload(), MAX_COMMAND_BYTES) - META_HEADROOM
        extra = DELTA_META_BOUND if self.pending is not None else 0
        biggest = max((_meta_bound(n, t) + extra for n, t in named), default=0)
        if biggest > limit:
            name = max(named, key=lambda nt: _meta_bound(*nt))[0]
            raise InvalidArgument(
                f"the metadata of tensor {name[:80]!r} alone is ~{biggest} bytes, over what one command may carry "
                f"({min(self._max_payload(), MAX_COMMAND_BYTES)} bytes: the NATS server's max_payload, at most "
                f"{MAX_COMMAND_BYTES}, less {META_HEADROOM} of headroom); shorten its name or raise max_payload"
            )
        ack: FleetAck | None = None
        if self.pending is None:
            if self.session_id is not None:
                self.stats.tensors += len(named)
                self.stats.elements += sum(t.numel() for _, t in named)
                self.stats.bytes_dense += sum(t.numel() * t.element_size() for _, t in named)
            ack = await self._send(named, {}, size, limit, biggest)
        else:
            groups = delta_groups(named)

            def encoding(group: list[tuple[str, torch.Tensor]]) -> asyncio.Future[Any]:
                return asyncio.ensure_future(detached(lambda: self._encode(group), name="rlbus-delta"))

            nxt = encoding(groups[0])
            try:
                for i in range(len(groups)):
                    sending, deltas = await nxt
                    if i + 1 < len(groups):
                        nxt = encoding(groups[i + 1])  # compared while this group travels
                    ack = await self._send(sending, deltas, size, limit, biggest) or ack
            finally:
                if not nxt.done():
                    nxt.cancel()
        if ack is None:  # nothing to send: still tell the controller (an empty update)
            ack = await self._call(UpdateWeights(params=[], buckets=[], session_id=self.session_id), FleetAck)
        return ack

    async def _send(
        self, named: list[tuple[str, torch.Tensor]], deltas: dict[str, Any], size: int, limit: int, biggest: int
    ) -> FleetAck | None:
        """Plan `named` (deltas' blobs among them), then per metadata chunk: its UpdateWeights
        through the controller, then its buckets. None when there was nothing to send."""
        from rlbus.transfer.base import TransferError, detached
        from rlbus.transfer.stream import packs_every_bucket, prepare_for, scratch_bytes, scratch_pair, send_stream

        tx = self.transfer
        if tx is None:
            raise FailedPrecondition("no weight-transfer group; call init_weight_transfer() first")
        plan = prepare_for(tx, named, size, max_tensors=max(1, limit // max(biggest, 1)))
        self.stats.bytes_sent += plan.total_bytes
        # on the wire a delta names its tensor's dtype and shape (the plan packed its bytes as uint8)
        per_bucket = [[deltas[m.name].meta(m) if m.name in deltas else m for m in ms] for ms in plan.per_bucket]
        # A transport that shares the trainer's memory (shm) hands out the scratch buffers
        # itself: every bucket is packed there and workers copy straight out of it.
        every = packs_every_bucket(tx)
        need = scratch_bytes(plan, named, pack_every_bucket=every)
        if self._scratch_of is not tx or min((b.numel() for b in self.scratch), default=-1) < need:
            self.scratch, self._scratch_of = scratch_pair(tx, need), tx
        ack: FleetAck | None = None
        for first, last in meta_chunks(per_bucket, limit):
            params = [
                msgspec.structs.replace(m, bucket=m.bucket - first) for k in range(first, last) for m in per_bucket[k]
            ]
            buckets = [msgspec.structs.replace(b, index=b.index - first) for b in plan.buckets[first:last]]
            ack = await self._call(
                UpdateWeights(
                    params=params,
                    buckets=buckets,
                    session_id=self.session_id,
                    group=self.init.group_name if self.init else "",
                ),
                FleetAck,
            )
            try:
                self.checksums += await detached(
                    lambda: send_stream(
                        tx, plan, named, first=first, last=last, scratch=self.scratch, pack_every_bucket=every
                    ),
                    name="rlbus-send",
                )
            except TransferError as e:
                self.close()
                raise Aborted(
                    f"sending weights failed ({e}); abort the session and init_weight_transfer() again"
                ) from None
        return ack

    async def finish(self, weight_version: str | None) -> FleetAck:
        pending, stats = self.pending, self.stats
        try:
            ack = await self._call(
                FinishWeightUpdate(
                    weight_version=weight_version,
                    checksums=self.checksums,
                    tensor_checksums=self.tensor_checksums,
                    session_id=self.session_id,
                ),
                FleetAck,
            )
        except RLBusError:
            if stats.delta:
                # a delta that did not commit may have met a worker whose bits are not the base
                # after all: the next tracked push goes dense, which heals it
                self.committed.pop(self._target, None)
            self.last = stats
            raise
        finally:
            self.pending = None
        self.session_id = None
        stats.committed = True
        self.last = stats
        if pending is not None:
            seqs = {w.weight_seq if self._target == "main" else w.draft_seq for w in ack.workers}
            if len(seqs) == 1:
                after = self.committed[self._target] = pending.commit(self.committed.get(self._target), seqs.pop())
                after.write_behind()  # the deltas onto the trainer's copy, off the push's time
            else:  # cannot happen after a commit every worker acked; then nothing is a safe base
                self.committed.pop(self._target, None)
        return ack

    def settle(self) -> None:
        """Wait until the last commit's deltas are written onto the trainer's copy (a thread
        writes them after each commit, off the push's time; the next push need not wait)."""
        for c in self.committed.values():
            c.settle()

    async def abort(self, reason: str) -> FleetAck:
        self.pending = None  # the snapshot stays at the last commit
        self.last = self.stats
        ack = await self._call(AbortWeightUpdate(reason=reason, session_id=self.session_id), FleetAck)
        self.checksums, self.session_id = [], None
        return ack

    @property
    def snapshot_bytes(self) -> int:
        """Host bytes held for deltas: the committed bits of every target, and the open session's record."""
        return sum(c.nbytes for c in self.committed.values()) + (self.pending.nbytes if self.pending else 0)


def byte_runs(tensors: Sequence[torch.Tensor], most: int, least: int = 0) -> list[list[int]]:
    """The indices of `tensors` cut, in order, into at most `most` runs of about equal bytes (at
    least `least` each, but the last); never empty (one empty run for no tensors)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    target = max(least, -(-total // most))
    runs: list[list[int]] = [[]]
    held = 0
    for i, t in enumerate(tensors):
        if held >= target:
            runs.append([])
            held = 0
        runs[-1].append(i)
        held += t.numel() * t.element_size()
    return runs


def delta_groups(named: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """`named` cut, in order, into at most DELTA_GROUPS groups of about equal bytes (at least
    DELTA_GROUP_MIN_BYTES each, but the last); never empty (one empty group for no tensors)."""
    runs = byte_runs([t for _, t in named], DELTA_GROUPS, DELTA_GROUP_MIN_BYTES)
    return [[named[i] for i in run] for run in runs]


PARTS_PER_THREAD = 1
"""A group's compares are cut into this many parts a compare thread, each one compiled call
(:func:`rlbus.transfer.delta.diff_many`). Measured (2026-12-07, the encode alone: 1 GiB bf16 in
520 tensors, 1.14 % changed, 8 groups, two threads, seven runs alternated): one part a thread
median 132 ms (CPU 219), two 140 (237), a call a tensor 168 (276)."""


def _meta_bound(name: str, t: torch.Tensor) -> int:
    return PARAM_META_BOUND + len(name.encode()) + 21 * t.dim()


def meta_chunks(per_bucket: list[list[ParamMeta]], limit: int) -> Iterator[tuple[int, int]]:
    """Consecutive bucket ranges whose encoded metadata stays under `limit` bytes (a bucket
    whose metadata alone passes it is the planner's to prevent: see max_tensors)."""
    first, size = 0, 200
    for k, metas in enumerate(per_bucket):
        cost = 64 + sum(len(encode(m)) + 1 for m in metas)
        if k > first and size + cost > limit:
            yield first, k
            first, size = k, 200
        size += cost
    if per_bucket:
        yield first, len(per_bucket)
