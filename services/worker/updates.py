"""The worker's side of weight updates: the transfer group, the open session, staged bytes.

staged mode: tensors are received into a shadow copy; commit copies them into the model
between two forward steps; abort drops the copy and the model never changed.
in_place mode: tensors are received straight into the model's parameters (no extra
memory, like vLLM); an abort after bytes arrived leaves the worker's weights dirty (its
books say so), and the engine refuses generation until a later update commits.

A repair session (a peer sends the committed weights to a worker that is behind) of the main
model lands in place whatever the mode when the worker is withheld (it serves nothing until
its main weights are the committed ones, and they are not anyway): no shadow copy, no copy at commit. Every tensor is hashed as
it lands and prepare checks those against the commit's manifest instead of bucket checksums.

A delta session (opened with a base commit sequence) may carry deltas: only the elements
that changed since that commit. Staged, each is written onto a copy of the committed tensor
(the copy is the staged tensor: the engine still receives full tensors at commit); in place,
onto the live tensor. Prepare then checks every such result against the trainer's checksum
of the full tensor, so nothing but a bit-identical result is committed.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import anyio
import torch
from rlbus.schemas import (
    Backend,
    BucketMeta,
    ParamMeta,
    TensorChecksum,
    TransferInit,
    UpdateMode,
    UpdateTarget,
    version_problem,
)
from rlbus.schemas.errors import Aborted, FailedPrecondition, Internal, InvalidArgument

from rlbus.transfer import delta
from rlbus.transfer.base import ChecksumMismatch, PlanError, TransferError, WorkerTransfer, detached
from rlbus.transfer.buckets import as_bytes, validate
from rlbus.transfer.checksum import checksum, checksum_kind
from rlbus.transfer.factory import worker_transfer
from rlbus.transfer.stream import group_checksum_kind, recv_buckets, sole_tensor_bytes, transfer_device, verify

from .book import Book
from .engine import Engine, EngineReceiver

log = logging.getLogger("rlbus.worker.updates")

MAX_NAMED_PROBLEMS = 20
"""A refusal names this many mismatched tensors at most: its reply must fit one NATS message."""


class _Session:
    def __init__(
        self,
        session_id: str,
        target: UpdateTarget,
        base_seq: int | None = None,
        *,
        in_place: bool = False,
        by_tensor: bool = False,
    ) -> None:
        self.session_id = session_id
        self.target = target
        self.base_seq = base_seq
        """A delta session's base commit (the worker held exactly it when the session opened)."""
        self.in_place = in_place
        """Bytes land in the live parameters (the in_place mode, or a repair of a withheld worker)."""
        self.by_tensor = by_tensor
        """A repair: every tensor is hashed as it lands (`hashed`) and checked against the
        manifest at prepare; buckets are not hashed."""
        self.hashed: dict[str, str] = {}
        """by_tensor: each received tensor's checksum, taken where it landed."""
        self.deltas: dict[str, str] = {}
        """Tensors built from a delta, with the checksum of what was built (hashed as it was
        built, while the next bucket arrives): each must match the trainer's at prepare."""
        self.staged: dict[str, torch.Tensor] = {}
        self.touched = False
        """in_place: some bytes reached the live parameters."""
        self.receiving = 0
        self.failure: Exception | None = None
        self.done = anyio.Event()
        self.done.set()
        self.received: set[str] = set()
        self.verified = False
        """prepare() found every receive done and every checksum matching; a receive after it
        makes it false again, and commit() requires it."""
        self.checksums: list[list[str]] = []
        """What each receive of this session hashed, in the order the updates arrived."""
        self.receives: set[anyio.CancelScope] = set()
        """The receives in flight: abort cancels them (their threads are abandoned)."""
        self.stopped = False
        """Aborted: a receive thread still running must not touch the model any more."""
        self._guard = threading.Lock()  # orders `stopped` against `touched` across the threads

    def touch(self) -> None:
        """A receive thread is about to write live parameters; refused once aborted."""
        with self._guard:
            if self.stopped:
                raise TransferError(f"session {self.session_id} was aborted")
            self.touched = True

    def check_live(self) -> None:
        """A receive thread goes on; refused once aborted."""
        if self.stopped:
            raise TransferError(f"session {self.session_id} was aborted")

    def stop(self) -> bool:
        """Abort: no receive writes the model from now on. True if one already did."""
        with self._guard:
            self.stopped = True
            for scope in self.receives:
                scope.cancel()
            return self.touched


class _Live(Mapping[str, torch.Tensor]):
    """The live parameters as a receive's copy destination: each lookup marks the session
    touched first, and is refused once it was aborted."""

    def __init__(self, s: _Session, live: Mapping[str, torch.Tensor]) -> None:
        self._s, self._live = s, live

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._live[name]
        self._s.touch()
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)


class WeightUpdates:
    """One per worker. All methods run on the worker's event loop and never block it:
    joins and receives run in daemon threads, and a group is closed without waiting for
    them (abort and teardown return at once whatever the data plane is doing)."""

    def __init__(self, engine: Engine, book: Book, backend: Backend | None, mode: UpdateMode) -> None:
        self.engine = engine
        self.book = book
        """The worker's books: a commit, a relabel and a torn in_place abort are recorded there."""
        self.backend = backend
        self.mode = mode
        self.rx: WorkerTransfer | None = None
        self._scratch: list[torch.Tensor] = []
        """Receive buffers of a host group kept between receives (two of its biggest bucket;
        a GPU group's are freed after each receive: that memory is the KV cache's)."""
        self.init: TransferInit | None = None
        self.session: _Session | None = None
        self._recv_lock = anyio.Lock()  # broadcasts arrive in order: one receive at a time
        self._joining: anyio.CancelScope | None = None
        """The join waiting for its rendezvous, if any."""

    @property
    def remote(self) -> EngineReceiver | None:
        """The engine's own receiver, when its processes take the bytes (vLLM)."""
        return self.engine.receiver

    @property
    def transfer_ready(self) -> bool:
        if self.remote is not None:
            return self.init is not None and self.remote.holds(self.init.group_name)
        return self.rx is not None

    @property
    def session_id(self) -> str | None:
        return self.session.session_id if self.session else None

    # ---- transfer group ----------------------------------------------------------------

    async def join(self, init: TransferInit, rank: int) -> None:
        if self.backend is None:
            raise FailedPrecondition(
                "this worker has no weight transfer backend; start it with --weight-transfer-backend"
            )
        if init.backend != self.backend:
            raise FailedPrecondition(f"this worker's backend is {self.backend}, not {init.backend}")
        if not 1 <= rank < init.world_size:
            raise InvalidArgument(f"rank {rank} outside 1..{init.world_size - 1}")
        if self.session is not None:
            raise FailedPrecondition(
                f"session {self.session.session_id} is open; finish or abort it before re-initialising"
            )
        self.teardown()
        self.cancel_join()  # a newer group supersedes one still forming
        if self.remote is not None:
            await self._join_remote(self.remote, init, rank)
            return
        rx = worker_transfer(init.backend)
        scope = self._joining = anyio.CancelScope()
        with scope:
            try:
                await detached(rx.join, init, rank, name="rlbus-join")
            except TransferError as e:
                rx.close()
                raise FailedPrecondition(f"could not join the weight-transfer group: {e}") from None
        if scope.cancelled_caught:
            rx.close()
            raise Aborted(f"joining group {init.group_name!r} was abandoned (a newer group, or the worker stopped)")
        self._joining = None
        self.rx, self.init = rx, init

    async def _join_remote(self, remote: EngineReceiver, init: TransferInit, rank: int) -> None:
        scope = self._joining = anyio.CancelScope()
        with scope:
            try:
                await remote.join(init, rank)
            except TransferError as e:
                remote.leave(init.group_name)
                raise FailedPrecondition(f"could not join the weight-transfer group: {e}") from None
        if scope.cancelled_caught:
            remote.leave(init.group_name)
            raise Aborted(f"joining group {init.group_name!r} was abandoned (a newer group, or the worker stopped)")
        self._joining = None
        self.init = init

    def cancel_join(self) -> None:
        """Abandon a join still waiting for its rendezvous (its thread ends at the group timeout)."""
        if self._joining is not None:
            self._joining.cancel()
            self._joining = None

    def teardown(self) -> None:
        """Leave the group at once; a receive still pending in it is abandoned, not awaited."""
        if self.rx is not None:
            self.rx.close()
        self._scratch = []
        if self.remote is not None and self.init is not None:
            self.remote.leave(self.init.group_name)
        self.rx = self.init = None

    # ---- session -----------------------------------------------------------------------

    def _open(self, session_id: str) -> _Session:
        s = self.session
        if s is None:
            raise FailedPrecondition(
                "no weight update session is open on this worker; call start_weight_update() first"
            )
        if session_id and session_id != s.session_id:
            raise FailedPrecondition(f"session {session_id} is not this worker's open session {s.session_id}")
        return s

    def base_problem(self, target: UpdateTarget, base_seq: int) -> str | None:
        """Why a delta against commit `base_seq` cannot be applied here (None: it can): the
        weights held must be exactly that commit, clean and loaded."""
        b = self.book
        held = b.main.seq if target == "main" else b.draft.seq
        if held != base_seq:
            return f"it holds {target} commit seq {held}, not the delta's base {base_seq}"
        if target == "main" and b.dirty:
            return "its weights are dirty (an in_place update was aborted)"
        if target == "main" and not self.engine.status().weights_loaded:
            return "its weights were discarded (level-2 sleep)"
        if b.withheld:
            return "it is withheld (not yet synced to the committed version)"
        return None

    def start(
        self, session_id: str, target: UpdateTarget, base_seq: int | None = None, *, repair: bool = False
    ) -> None:
        """Open a session. ``repair``: a peer's repair (StartWeightUpdateWorker.repair): a
        withheld worker receiving into its own processes lands it in place and hashes by tensor."""
        if self.session is not None:
            if self.session.session_id == session_id:
                return
            raise FailedPrecondition(f"session {self.session.session_id} is already open; finish or abort it first")
        if "weights" in self.engine.status().sleeping_tags:
            raise FailedPrecondition(
                "weights are asleep; call wake_up(tags=['weights']) before updating them "
                "(level 2: wake weights -> update -> wake kv_cache)"
            )
        self.engine.param_specs(target)  # refuses a target the engine does not have
        by_tensor = repair and self.remote is None
        # in place only for the main model: the worker stays withheld for as long as its main
        # label is not the committed one, i.e. until this session commits (a draft's label
        # does not withhold it, so a draft repair keeps its bytes aside)
        in_place = self.mode == "in_place" or (by_tensor and target == "main" and self.book.withheld)
        self.session = _Session(session_id, target, base_seq, in_place=in_place, by_tensor=by_tensor)

    def check(self, session_id: str, params: Sequence[ParamMeta], buckets: Sequence[BucketMeta]) -> None:
        """Names, dtypes and shapes against the model, before any byte moves."""
        s = self._open(session_id)
        try:
            validate(params, buckets)
        except PlanError as e:
            raise InvalidArgument(f"inconsistent weight metadata: {e}") from None
        specs = self.engine.param_specs(s.target)
        problems = []
        if s.base_seq is None and any(m.encoding != "dense" for m in params):
            raise InvalidArgument("delta-encoded tensors in a dense session; open it with base_seq")
        for m in params:
            spec = specs.get(m.name)
            if spec is None:
                problems.append(f"{m.name} (unknown parameter)")
            elif str(spec.dtype).removeprefix("torch.") != m.dtype:
                problems.append(f"{m.name} (dtype {m.dtype}, model has {str(spec.dtype).removeprefix('torch.')})")
            elif tuple(m.shape) != tuple(spec.shape):
                problems.append(f"{m.name} (shape {list(m.shape)}, model has {list(spec.shape)})")
        if problems:
            shown = ", ".join(problems[:MAX_NAMED_PROBLEMS])
            more = f", and {len(problems) - MAX_NAMED_PROBLEMS} more" if len(problems) > MAX_NAMED_PROBLEMS else ""
            raise InvalidArgument(f"{len(problems)} tensors do not match the {s.target} model: {shown}{more}")

    def receive(self, session_id: str, params: Sequence[ParamMeta], buckets: Sequence[BucketMeta], tg) -> None:
        """Start receiving (checked) tensors in the background; prepare() waits for it."""
        self.check(session_id, params, buckets)
        s = self._open(session_id)
        if self.remote is not None:
            self._receive_remote(self.remote, s, params, buckets, tg)
            return
        rx = self.rx
        if rx is None:
            if not buckets:
                return  # nothing to receive: an empty update needs no group
            raise FailedPrecondition("no weight-transfer group; call init_weight_transfer() first")
        sums = s.checksums
        sums.append([])
        mine = len(sums) - 1
        live = self.engine.parameters_of(s.target)
        staged_buffers: set[int] = set()
        deltas = {m.name: m for m in params if m.encoding == "delta"}
        kind = group_checksum_kind(rx)  # a delta's result is hashed as the trainer hashed it

        def landing(bucket: BucketMeta, metas: Sequence[ParamMeta]) -> torch.Tensor | None:
            """Receive straight into final memory: the live parameter (in_place, a bucket that
            is exactly one contiguous tensor) or a fresh buffer that becomes the staged copy."""
            s.check_live()
            if not s.in_place:
                fresh = torch.empty(bucket.nbytes, dtype=torch.uint8)
                staged_buffers.add(fresh.data_ptr())
                return fresh
            buf = sole_tensor_bytes(metas, bucket.nbytes, live)
            if buf is not None:
                s.touch()
            return buf

        def sink(name: str, view: torch.Tensor) -> None:
            m = deltas.get(name)
            if m is not None:
                if s.in_place:
                    s.touch()
                    out = live[name]
                else:
                    s.check_live()
                    out = live[name].detach().clone()  # the committed tensor, the delta's base
                try:
                    delta.write(out, view, m)  # refused before anything is written
                except delta.DeltaError as e:
                    # the stream goes on (the group stays usable); prepare refuses the session
                    s.failure = s.failure or ChecksumMismatch(0, "", "", detail=f"undecodable delta: {e}")
                    return
                if not s.in_place:
                    s.staged[name] = out
                s.deltas[name] = checksum(as_bytes(out), kind)
                s.received.add(name)
                return
            if s.in_place:
                s.touch()
                if view.data_ptr() != live[name].data_ptr():  # not landed or copied there already
                    live[name].copy_(view)
                view = live[name]
            else:
                s.check_live()
                view = s.staged[name] = view if view.untyped_storage().data_ptr() in staged_buffers else view.clone()
            if s.by_tensor:  # where it will be served from, while the next bucket arrives
                s.hashed[name] = checksum(as_bytes(view), checksum_kind())  # the manifest's algorithm
            s.deltas.pop(name, None)  # sent again whole in this session
            s.received.add(name)

        def receive_all() -> list[str]:
            return recv_buckets(
                rx,
                list(params),
                list(buckets),
                sink,
                landing=landing,
                into=_Live(s, live) if s.in_place else None,
                hash_buckets=not s.by_tensor,
                scratch=self._scratch if transfer_device(rx).type == "cpu" else None,
            )

        async def work() -> None:
            sums[mine] = await detached(receive_all, name="rlbus-receive")

        def broken() -> None:
            if self.rx is rx:
                self.teardown()  # a broken group cannot be trusted for the next session

        self._start_receive(s, work, broken, tg)

    def _start_receive(self, s: _Session, work: Callable[[], Awaitable[None]], broken: Callable[[], None], tg) -> None:
        """Run one receive in the background, counted in the session (prepare() waits for the
        count to reach 0); a failure is kept for prepare, a broken group torn down."""
        if s.receiving == 0:
            s.done = anyio.Event()
        s.receiving += 1
        s.verified = False
        scope = anyio.CancelScope()
        s.receives.add(scope)

        async def run() -> None:
            try:
                with scope:
                    async with self._recv_lock:
                        await work()
            except TransferError as e:
                s.failure = s.failure or e
                broken()
            except Exception as e:
                log.exception("receive failed")
                s.failure = s.failure or e
            finally:
                s.receives.discard(scope)
                if scope.cancelled_caught:
                    s.failure = s.failure or TransferError("the receive was cancelled")
                s.receiving -= 1
                if s.receiving == 0:
                    s.done.set()

        tg.start_soon(run)

    def _receive_remote(
        self, remote: EngineReceiver, s: _Session, params: Sequence[ParamMeta], buckets: Sequence[BucketMeta], tg
    ) -> None:
        """The engine's processes receive (and hash) the bytes; this keeps the session's count."""
        if self.init is None:
            if not buckets:
                return
            raise FailedPrecondition("no weight-transfer group; call init_weight_transfer() first")
        group = self.init.group_name

        async def work() -> None:
            if s.in_place and buckets:
                s.touch()  # from the first byte on, the engine's committed copy may be torn
            else:
                s.check_live()
            await remote.receive(s.session_id, s.target, params, buckets, in_place=s.in_place)
            s.received.update(m.name for m in params)

        def broken() -> None:
            if self.init is not None and self.init.group_name == group:
                self.teardown()  # a broken group cannot be trusted for the next session

        self._start_receive(s, work, broken, tg)

    def prepares_at_once(self, session_id: str, tensor_checksums: Sequence[TensorChecksum] = ()) -> bool:
        """prepare() would not wait: every receive of the session is done and nothing is left
        to hash in a thread or ask of a remote engine (a dense in-process session: its bucket
        checksums are compared as they are). Such a prepare answers inside the NATS callback."""
        s = self.session
        return (
            s is not None
            and s.session_id == session_id
            and not s.receiving
            and self.remote is None
            and not s.by_tensor
            and not s.deltas
            and not tensor_checksums
        )

    async def prepare(
        self,
        session_id: str,
        timeout: float,
        checksums: Sequence[str] = (),
        *,
        tensor_checksums: Sequence[TensorChecksum] = (),
    ) -> None:
        """Phase 1 of finish: every receive done, every bucket's bytes hash to the trainer's
        checksum (sent with finish, in the order the buckets were sent), and every tensor
        built from a delta hashes to the trainer's checksum of the full result."""
        s = self._open(session_id)
        with anyio.move_on_after(timeout):
            await s.done.wait()
        if s.receiving:
            raise Aborted(f"still receiving weights after {timeout:g}s; the trainer did not send every bucket")
        if s.failure is None and self.remote is not None:
            problem = await self.remote.verify(session_id, checksums, tensor_checksums)
            if problem:
                s.failure = ChecksumMismatch(0, "", "", detail=problem)
        elif s.failure is None and s.by_tensor:
            if not tensor_checksums and s.received:
                s.failure = ChecksumMismatch(0, "", "", detail="a repair without the manifest to verify it against")
        elif s.failure is None:
            try:
                verify([c for part in s.checksums for c in part], checksums)
            except ChecksumMismatch as e:
                s.failure = e
        if s.failure is None and self.remote is None and (s.deltas or tensor_checksums):
            problem = await detached(lambda: self._check_results(s, tensor_checksums), name="rlbus-verify")
            if problem:
                s.failure = ChecksumMismatch(0, "", "", detail=problem)
        if isinstance(s.failure, ChecksumMismatch):
            raise Aborted(f"checksum mismatch: {s.failure}")
        if s.failure is not None:
            raise Aborted(f"receiving weights failed: {type(s.failure).__name__}: {s.failure}")
        s.verified = True

    def _check_results(self, s: _Session, sums: Sequence[TensorChecksum]) -> str | None:
        """Every tensor a delta built against the trainer's checksum of the result (a tensor
        the trainer names that no delta built is hashed now; runs in a thread); why they
        fail, or None."""
        want = {c.name: c.checksum for c in sums}
        missing = sorted(s.deltas.keys() - want.keys())
        if missing:
            return f"no result checksum from the trainer for delta tensors {missing[:MAX_NAMED_PROBLEMS]}"
        unnamed = sorted(s.received - want.keys()) if s.by_tensor else []
        if unnamed:
            return f"the manifest does not name received tensors {unnamed[:MAX_NAMED_PROBLEMS]}"
        live = self.engine.parameters_of(s.target)
        bad = []
        for name, expected in want.items():
            got = s.deltas.get(name) or s.hashed.get(name)
            if got is None:
                t = s.staged.get(name) if not s.in_place and name in s.staged else live.get(name)
                got = checksum(as_bytes(t.cpu())) if name in s.received and t is not None else None
            if got != expected:
                bad.append(name)
        if bad:
            return f"{len(bad)} tensors are not bit-identical to the trainer's after the update: {bad[:MAX_NAMED_PROBLEMS]}"
        return None

    async def commit(self, session_id: str, version: str | None, seq: int) -> None:
        """Phase 2 of finish: apply staged tensors, take the version and its seq (together, in
        the engine's load: the label moves with the weights), close the session."""
        s = self._open(session_id)
        if version is not None and (problem := version_problem(version)):
            raise InvalidArgument(problem)
        if s.receiving or s.failure is not None or not s.verified:
            raise Internal("commit before a successful prepare: nothing unverified is applied")

        def take() -> None:
            self.book.commit(s.target, version, seq)

        held_bytes = bool(s.staged or s.received)
        if self.remote is not None and s.received:
            try:
                await self.remote.commit(session_id, s.target, version, take)
            except Exception:
                if s.in_place and s.touched:
                    self.book.tear(s.target)  # its committed copy holds bits no commit took here
                raise
        elif held_bytes:
            written = s.received if s.in_place else set()
            await self.engine.load_weights(s.target, s.staged, written, loaded=take)
        else:
            take()
        s.staged.clear()
        self.session = None
        if held_bytes:  # the shadow copy's pages go back to the OS (a session that moved no byte freed none)
            await detached(release_freed_memory, name="rlbus-trim")

    def abort(self, session_id: str) -> bool:
        """Drop the session at once; True if one was open. A receive still waiting is
        cancelled and its group closed without waiting for it (the group is not reused)."""
        s = self.session
        if s is None or (session_id and session_id != s.session_id):
            return False
        touched = s.stop()
        if self.remote is not None:
            self.remote.abort(s.session_id)
        if s.receiving:
            self.teardown()
        if s.in_place and touched:
            self.book.tear(s.target)  # half-written: dirty (main); no delta may take the draft as a base
        s.staged.clear()
        self.session = None
        threading.Thread(target=release_freed_memory, name="rlbus-trim", daemon=True).start()
        return True

    def set_version(self, version: str, seq: int) -> None:
        """update_weight_version: the weights held take a new version and seq."""
        if problem := version_problem(version):
            raise InvalidArgument(problem)
        if self.session is not None:
            raise FailedPrecondition(f"session {self.session.session_id} is open; finish or abort it first")
        self.book.relabel(version, seq)


def release_freed_memory() -> None:
    """glibc keeps freed multi-MiB tensor blocks in its arenas; give them back to the OS so a
    staged worker idles at one model, not two (measured: 777 -> ~480 MiB for a 241 MiB model)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
