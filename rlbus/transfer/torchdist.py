"""torch.distributed backends (``gloo`` on CPUs, ``nccl`` on GPUs) over standalone groups.

Each transfer builds its own process group from a TCPStore the trainer hosts,
never the global default group, so several ranks can live in one process and a
group can be torn down and rebuilt. Every rank receives every bucket rank 0 sends, in
order: over gloo as a send to each receiving rank, tagged with the bucket's number in the
group; over nccl (or a gloo group made with ``broadcasts=True``) as one broadcast. A bucket
is sent from and received into the caller's buffer where it lies when that is the group's
device (the host for gloo, the GPU for nccl); a buffer elsewhere is staged through one on
the group's device (e.g. a host landing buffer over nccl: the worker's staged copy kept on
the host).

A process exiting with a transfer in flight first closes its groups and waits (at most
``EXIT_SETTLE_S``) for every thread inside a torch.distributed wait or a group's teardown to
come back (``_settle_at_exit``): a thread that comes back while Python 3.11-3.13 finalizes
is ended with pthread_exit through torch's C++, and the process aborts.
"""

from __future__ import annotations

import atexit
import ipaddress
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist

from rlbus.schemas import TransferInit
from rlbus.transfer.base import Handle, TransferError, native_calls, timeout_error
from rlbus.transfer.checksum import checksum_kind
from rlbus.transfer.rendezvous import connect_store, host_store

TorchBackend = Literal["gloo", "nccl"]

EXIT_SETTLE_S = 1.0
"""How long an exiting process waits for its transfers' threads to come back from torch."""


_open_groups: weakref.WeakSet[_Group] = weakref.WeakSet()


@atexit.register
def _settle_at_exit() -> None:
    """Before the interpreter finalizes: close every group still open and give the threads
    waiting in them (a closed group or a departed peer wakes them with an error) time to come
    back. A gloo broadcast stuck until its timeout is left behind after ``EXIT_SETTLE_S``."""
    for group in list(_open_groups):
        group.close()
    native_calls.settle(EXIT_SETTLE_S)


class _NotOpen:
    """The group before open/join and after close: every data call is refused."""

    def __getattr__(self, name: str):
        raise TransferError("transfer group is not open")


class _WorkHandle:
    """A bucket in flight (a broadcast, or a send to each receiving rank); ``wait`` bounds
    it, all of its works together, by the group timeout."""

    def __init__(
        self,
        works: list[dist.Work],
        init: TransferInit,
        what: str,
        keep: object = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        self._works, self._init, self._what, self._keep, self._after = works, init, what, keep, after
        self._done = False
        self._failed: TransferError | None = None
        """Why the wait failed: a later wait fails the same way (the works are gone by then)."""

    def wait(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._done:
            return
        works, self._works = self._works, []
        with native_calls.inside():  # the last reference to a work may go here: see NativeCalls
            try:
                deadline = time.monotonic() + self._init.timeout_s
                while works:
                    works[0].wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                    del works[0]
                if self._after is not None:
                    self._after()
            except Exception as e:
                self._failed = timeout_error(self._init, self._what, e)
                raise self._failed from e
            finally:
                works.clear()
                self._keep = None
        self._done = True


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class _Group:
    """A standalone process group plus the store it was formed on."""

    def __init__(
        self, backend: TorchBackend = "gloo", device: torch.device | None = None, *, broadcasts: bool | None = None
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown torch.distributed backend {backend!r}")
        if backend == "nccl" and broadcasts is False:
            raise ValueError("over nccl buckets move as broadcasts")
        self.backend = backend
        self.broadcasts = backend == "nccl" if broadcasts is None else broadcasts
        """Whether each bucket moves as one broadcast (nccl's way; a gloo group's when asked)
        or as a tagged send to each receiving rank (gloo's default: a send starts on the
        caller's thread, where a broadcast goes through the group's work thread, ~0.3-0.6 ms
        a bucket; bench/push.py at R = 1, 2026-12-06: 0.93-0.96x bare, 0.83x with broadcasts).
        Every rank of a group must agree."""
        self.checksum_kind = checksum_kind(backend)
        """The group's bucket checksum (see rlbus.transfer.checksum): the same on every rank."""
        self._device = device
        self._pg: dist.ProcessGroup | _NotOpen = _NotOpen()
        self._store: dist.Store | None = None
        self._raw: dist.TCPStore | None = None
        self._init: TransferInit | None = None
        self._sent = 0
        """Buckets sent or received in this group: the next one's number (its tag over gloo)."""
        self._works: list[dist.Work] = []
        """Works started and maybe not finished: close abandons a group that has one."""
        self._lock = threading.Lock()  # a collective starting vs close, across threads

    @property
    def device(self) -> torch.device:
        if self.backend == "gloo":
            return torch.device("cpu")
        if self._device is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    def _form(self, init: TransferInit, store: dist.Store, rank: int) -> None:
        timeout = timedelta(seconds=init.timeout_s)
        try:
            if self.backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = timeout
                dev = (
                    dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
                    if _is_loopback(init.master_addr)
                    else dist.ProcessGroupGloo.create_default_device()
                )
                opts._devices = [dev]
                _name(opts, init)
                # Constructing the gloo group connects the full mesh: it returns only
                # once every rank is in, or raises after the store timeout.
                pg = dist.ProcessGroupGloo(store, rank, init.world_size, opts)
            else:
                if not torch.cuda.is_available():
                    raise TransferError("nccl backend needs CUDA")
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                opts.is_high_priority_stream = False
                _name(opts, init)
                pg = dist.ProcessGroupNCCL(store, rank, init.world_size, opts)  # type: ignore[assignment]
                # NCCL forms its communicator lazily; one tiny broadcast forms it now.
                probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
                _WorkHandle([pg.broadcast([probe], _root0())], init, "forming the nccl group").wait()  # type: ignore[attr-defined]
        except TransferError:
            raise
        except Exception as e:
            raise timeout_error(init, f"rank {rank} joining ({self.backend})", e) from e
        self._pg = pg  # type: ignore[assignment]
        self._init = init
        self._sent = 0  # every rank of a new group numbers its buckets from 0
        _open_groups.add(self)

    def _move(
        self, tensor: torch.Tensor, sending: bool, keep: object = None, after: Callable[[], None] | None = None
    ) -> Handle:
        """Start moving the group's next bucket: rank 0 sends ``tensor`` (``sending``), any
        other rank receives into it."""
        with self._lock:
            init, n = self._init, self._sent
            self._sent += 1
            what = f"{'sending' if sending else 'receiving'} bucket {n}"
            try:
                if self.broadcasts:
                    works = [self._pg.broadcast([tensor], _root0())]
                elif sending:
                    assert init is not None
                    works = [self._pg.send([tensor], dst, n) for dst in range(1, init.world_size)]
                else:
                    works = [self._pg.recv([tensor], 0, n)]
            except TransferError:
                raise
            except Exception as e:
                assert init is not None
                raise timeout_error(init, what, e) from e
            assert init is not None
            self._works = [w for w in self._works if not w.is_completed()] + works
        return _WorkHandle(works, init, what, keep=keep, after=after)

    def close(self) -> None:
        """Drop the group and the store at once, never waiting for a collective.

        Destroying a process group joins its threads, and those wait for a pending
        collective (until the peer closes or ``timeout_s`` passes). So a group with a
        collective in flight is abandoned to a daemon thread that destroys it: the caller
        returns at once, a new group can be formed meanwhile, and the process can exit
        meanwhile. An idle group is destroyed here (quickly), so a process that closes
        and exits leaves no thread behind."""
        with self._lock:
            busy = any(not w.is_completed() for w in self._works)
            box: list[object] = [self._pg, self._store, self._raw]  # the only references left: _destroy takes them
            self._pg, self._store, self._raw, self._init, self._works = _NotOpen(), None, None, None, []
        _open_groups.discard(self)
        if isinstance(box[0], _NotOpen):
            return
        if busy:
            native_calls.thread(partial(_destroy, box, self.backend), "rlbus-close-group")
        else:
            with native_calls.inside():
                _destroy(box, self.backend)


def _destroy(box: list[object], backend: TorchBackend) -> None:
    """Destroy the group in ``box[0]``; an nccl group is aborted first so no kernel lingers.
    This call empties ``box``, so the group's last reference dies in it, on its thread."""
    pg = box[0]
    box.clear()
    if backend == "nccl":
        for stop in ("abort", "shutdown"):
            fn = getattr(pg, stop, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:
                    continue
    del pg  # joins the group's threads, which wait for a pending collective


def _name(opts: object, init: TransferInit) -> None:
    # Names the group in torch's logs and flight recorder; several groups may share a process.
    for attr, value in (("group_name", init.group_name), ("global_ranks_in_group", list(range(init.world_size)))):
        if hasattr(opts, attr):
            setattr(opts, attr, value)


def _root0() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def _check_buf(buf: torch.Tensor) -> None:
    if buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise TransferError("buckets travel as contiguous uint8 tensors")


class TorchDistTrainer(_Group):
    """Rank 0 of a gloo/nccl weight-transfer group."""

    def bind(self, init: TransferInit) -> TransferInit:
        """Host the rendezvous store now (port 0 = a free one); return init with the port."""
        if self._raw is not None:
            raise TransferError("already bound; close() before binding again")
        self._store, self._raw, bound = host_store(init)
        self._init = bound
        return bound

    def open(self, init: TransferInit) -> TransferInit:
        """Bind if needed, then block until every rank joined (TransferTimeout otherwise)."""
        if self._raw is None:
            self.bind(init)
        assert self._store is not None and self._init is not None
        bound = self._init
        try:
            self._form(bound, self._store, 0)
        except TransferError:
            self.close()
            raise
        return bound

    def send(self, buf: torch.Tensor) -> Handle:
        """Send ``buf`` to every other rank; the handle completes when it left this rank. A
        buffer off the group's device is staged onto it first."""
        _check_buf(buf)
        if buf.device == self.device:
            return self._move(buf, True)
        staging = buf.to(self.device, non_blocking=False)
        return self._move(staging, True, keep=staging)


class TorchDistWorker(_Group):
    """A receiving rank of a gloo/nccl weight-transfer group."""

    def join(self, init: TransferInit, rank: int) -> None:
        """Connect to the trainer's store and block until the group is formed."""
        if not 1 <= rank < init.world_size:
            raise TransferError(f"rank {rank} outside 1..{init.world_size - 1}")
        self._store, self._raw = connect_store(init)
        try:
            self._form(init, self._store, rank)
        except TransferError:
            self.close()
            raise

    def recv(self, buf: torch.Tensor) -> Handle:
        """Receive the next bucket into ``buf`` (exactly the bucket's size), where it lies
        if it is on the group's device, else through a staging buffer there."""
        _check_buf(buf)
        if buf.device == self.device:
            return self._move(buf, False)
        staging = torch.empty(buf.numel(), dtype=torch.uint8, device=self.device)
        return self._move(staging, False, keep=staging, after=lambda: buf.copy_(staging))  # type: ignore[arg-type]
