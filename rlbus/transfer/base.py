"""What a transfer backend is: the trainer and worker protocols, handles, typed errors.

Every call here is a plain blocking function: services run them in a thread they
own (:func:`detached`), never on the event loop. No call may block forever: every wait
is bounded by ``TransferInit.timeout_s``. ``close`` never waits for a transfer in flight:
that transfer is abandoned (it fails, or times out, on its own), so an abort is instant
whatever the data plane is doing.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from rlbus.schemas import TransferInit


class TransferError(Exception):
    """The data plane failed; the group is no longer usable and should be closed."""


class TransferTimeout(TransferError):
    """A rendezvous or a transfer did not finish within ``TransferInit.timeout_s``."""


class PlanError(TransferError, ValueError):
    """Tensor or bucket metadata is inconsistent (bad dtype, overlapping or out-of-range bytes)."""


class UnsupportedDType(PlanError):
    """A torch dtype (or DType name) the wire contract has no name for."""


class ChecksumMismatch(TransferError):
    """The received buckets do not hash to the trainer's checksums (or are not as many)."""

    def __init__(
        self, bucket: int, expected: str, got: str, *, others: tuple[int, ...] = (), detail: str | None = None
    ) -> None:
        more = f" (and buckets {list(others)})" if others else ""
        super().__init__(detail or f"bucket {bucket}: checksum {got} != expected {expected}{more}")
        self.bucket = bucket
        self.expected = expected
        self.got = got
        self.others = others
        """Indices of further buckets that also failed verification."""


@runtime_checkable
class Handle(Protocol):
    """An operation in flight."""

    def wait(self) -> None:
        """Block until the operation is done; raise TransferError/TransferTimeout on failure."""
        ...


@runtime_checkable
class TrainerTransfer(Protocol):
    """Rank 0 of a weight-transfer group: hosts the rendezvous and sends buckets."""

    def bind(self, init: TransferInit) -> TransferInit:
        """Start hosting the rendezvous without waiting for anyone.

        Returns ``init`` with ``master_port`` filled in (a free port when it was 0),
        so the trainer can hand it to workers before blocking in :meth:`open`.
        """
        ...

    def open(self, init: TransferInit) -> TransferInit:
        """Bind if not yet bound, then block until all ``world_size`` ranks joined.

        Raises TransferTimeout after ``init.timeout_s``. Returns the bound init.
        """
        ...

    def send(self, buf: torch.Tensor) -> Handle:
        """Start sending the next bucket (a contiguous uint8 tensor) to every worker.

        ``buf`` is sent where it lies when it is on the group's device (``device``: the host
        for gloo and shm, the GPU for nccl), else staged onto it. It must not be modified
        until the handle's ``wait()`` returned.
        """
        ...

    def close(self) -> None:
        """Tear the group down and return at once, whatever is in flight (a pending
        send fails or is abandoned); safe to call twice or after a failure."""
        ...


@runtime_checkable
class SharedMemoryTrainer(TrainerTransfer, Protocol):
    """A trainer whose workers share its host memory (the shm backend)."""

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` in memory that workers can read.

        Packing buckets into such buffers means workers copy straight out of them
        (no copy into a transport slot first). The buffer lives until ``close()``;
        do not modify a region until the send of it was waited on.
        """
        ...


@runtime_checkable
class WorkerTransfer(Protocol):
    """Rank ``rank`` (>= 1) of a weight-transfer group: receives buckets."""

    def join(self, init: TransferInit, rank: int) -> None:
        """Connect to the trainer's rendezvous; block until the group is formed.

        Raises TransferTimeout after ``init.timeout_s``.
        """
        ...

    def recv(self, buf: torch.Tensor) -> Handle:
        """Start receiving the next bucket into ``buf`` (contiguous uint8 of exactly the
        bucket's size; on the group's device it is received in place, elsewhere through a
        staging buffer). Receives complete in the order they were started."""
        ...

    def close(self) -> None:
        """Leave the group and return at once, whatever is in flight (a pending receive
        fails or is abandoned: its buffer may still be written until it ends); safe to
        call twice or after a failure."""
        ...


@runtime_checkable
class ViewHandle(Protocol):
    """A receive in flight whose bytes stay where the transport holds them."""

    def wait(self) -> torch.Tensor:
        """Block until the bucket arrived; return a uint8 view of it, readable until
        :meth:`release`. Raise TransferError/TransferTimeout on failure."""
        ...

    def release(self) -> None:
        """Done reading the view: the trainer may reuse that memory (once every worker
        released it). Do not touch the view afterwards."""
        ...


@runtime_checkable
class SharedMemoryWorker(WorkerTransfer, Protocol):
    """A worker that can read buckets in the trainer's memory (the shm backend)."""

    def recv_view(self, nbytes: int) -> ViewHandle:
        """Take the next bucket (of ``nbytes``) where it lies, copying nothing.

        Completes in order with :meth:`recv`: bucket ``k`` is whichever of the two
        was started ``k``-th.
        """
        ...


def timeout_error(init: TransferInit, what: str, cause: BaseException | None = None) -> TransferError:
    """Sort a torch/store failure: a timeout becomes TransferTimeout, anything else TransferError."""
    text = f"{what} failed in group {init.group_name!r}" + (f": {cause}" if cause else "")
    msg = str(cause or "").lower()
    if cause is None or "timeout" in msg or "timed out" in msg or isinstance(cause, TimeoutError):
        return TransferTimeout(
            f"{what} timed out after {init.timeout_s}s in group {init.group_name!r}" + (f": {cause}" if cause else "")
        )
    return TransferError(text)


T = TypeVar("T")


KEPT_THREADS = 4
"""Idle threads :meth:`NativeCalls.thread` keeps for its next calls."""

KEPT_IDLE_S = 30.0
"""How long a kept thread waits for a call before it ends."""

IDLE_NAME = "rlbus-idle"


class NativeCalls:
    """How many threads of this process are in a transfer call that may leave the GIL inside
    torch (a wait, a group's teardown, the last reference to a torch work going): none may
    come back to Python while the interpreter finalizes. Python 3.11-3.13 ends such a thread
    with pthread_exit, which cannot unwind through torch's C++, and the process aborts
    ("terminate called without an active exception", SIGABRT). An exiting process waits
    for the count to reach zero first (rlbus.transfer.torchdist's exit handler).

    The threads are kept (up to KEPT_THREADS idle, each for KEPT_IDLE_S): starting one blocks
    its caller until the new thread runs, ~1.2 ms on 2 busy cores, and the callers are event
    loops (a delta push starts two a group: 16 starts, ~19 ms of the trainer's loop blocked
    a push, measured with cProfile). A kept thread takes the next call at once. What a call
    keeps per thread stays with a kept thread while it idles (the checksum's scratch blocks:
    2 MiB on the host, 32 MiB on a GPU), and is reused by its next call."""

    def __init__(self) -> None:
        self._forget_kept()
        me = weakref.ref(self)

        def in_child() -> None:
            calls = me()
            if calls is not None:
                calls._forget_kept()

        os.register_at_fork(after_in_child=in_child)

    def _forget_kept(self) -> None:
        """No call running and no thread kept: a fresh start, or a child just forked (which has
        none of its parent's threads, and perhaps a lock one of them held)."""
        self._cv = threading.Condition()
        self._count = 0
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], None], str]]] = []

    def _add(self, n: int) -> None:
        with self._cv:
            self._count += n
            self._cv.notify_all()

    @contextmanager
    def inside(self) -> Iterator[None]:
        self._add(1)
        try:
            yield
        finally:
            self._add(-1)

    def thread(self, body: Callable[[], None], name: str) -> None:
        """Run ``body`` in a daemon thread (a kept one, or a new one) named ``name``, counted
        from before it starts (an exit that waits cannot miss a thread started just before it)
        until ``body`` returns."""

        def run() -> None:
            try:
                body()
            finally:
                self._add(-1)

        self._add(1)
        try:
            with self._cv:
                kept = self._idle.pop() if self._idle else None
            if kept is not None:
                kept.put((run, name))
                return
            jobs: queue.SimpleQueue[tuple[Callable[[], None], str]] = queue.SimpleQueue()
            jobs.put((run, name))
            threading.Thread(target=self._serve, args=(jobs,), name=name, daemon=True).start()
        except BaseException:
            self._add(-1)
            raise

    def _serve(self, jobs: queue.SimpleQueue[tuple[Callable[[], None], str]]) -> None:
        """A kept thread: each call handed to it, then idle (renamed) until the next or until
        KEPT_IDLE_S pass. A call that raises ends the thread, as it would a thread of its own."""
        me = threading.current_thread()
        run, me.name = jobs.get()
        while True:
            run()
            me.name = IDLE_NAME
            with self._cv:
                if len(self._idle) >= KEPT_THREADS:
                    return
                self._idle.append(jobs)
            try:
                run, me.name = jobs.get(timeout=KEPT_IDLE_S)
            except queue.Empty:
                with self._cv:
                    if jobs in self._idle:  # not handed a call meanwhile: end
                        self._idle.remove(jobs)
                        return
                run, me.name = jobs.get()  # taken just as it timed out: the call is on its way

    def settle(self, timeout_s: float) -> bool:
        """Wait until no thread is inside; False if one still is after ``timeout_s``."""
        with self._cv:
            return self._cv.wait_for(lambda: self._count == 0, timeout_s)


native_calls = NativeCalls()


async def detached(fn: Callable[..., T], *args: object, name: str = "rlbus-transfer") -> T:
    """Run a blocking transfer call in a daemon thread of its own and await its result.

    Cancelling the await abandons the call: it goes on until it ends (every call is
    bounded by ``timeout_s``, and closing its group makes it fail sooner), but nothing
    waits for it, not even interpreter exit, as it would for a thread of a pool."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: object) -> None:
        if not result.done():  # the awaiting task may have been cancelled
            if ok:
                result.set_result(value)  # type: ignore[arg-type]
            else:
                result.set_exception(value)  # type: ignore[arg-type]

    call: list[Any] = [fn, args]  # dropped inside the count: the call may hold torch works

    def body() -> None:
        try:
            ok, value = True, call[0](*call[1])
        except Exception as e:
            ok, value = False, e  # type: ignore[assignment]
        call.clear()
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: nobody awaits this any more
            pass
        del value  # an error's traceback holds the call's frames

    native_calls.thread(body, name)
    return await result
