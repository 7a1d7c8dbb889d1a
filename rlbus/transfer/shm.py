"""Shared-memory backend: trainer and workers on one host, no sockets for the bytes.

The trainer owns one POSIX shared-memory segment of two slots (double buffering)
and signals through the rendezvous TCPStore: bucket ``k`` is copied into slot
``k % 2`` and announced as ``ready/k`` = ``<segment>|<offset>|<nbytes>``; every
worker copies it out and increments ``ack/k``; the last one sets ``acked/k``. The
trainer reuses a slot only after its previous bucket was acked by all workers.

The segment is sized lazily from the first bucket (or ``slot_bytes``) and
replaced by a larger one when a bigger bucket comes, so no maximum has to be
known at open. Only the trainer unlinks; workers map segments with ``shm_open``
directly, so Python's resource tracker never adopts (and never unlinks or warns
about) a segment a worker merely reads.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
from datetime import timedelta
from multiprocessing import shared_memory

import torch
import torch.distributed as dist
import xxhash

from rlbus.schemas import TransferInit
from rlbus.transfer.base import Handle, TransferError, ViewHandle, timeout_error
from rlbus.transfer.buckets import align_up
from rlbus.transfer.checksum import checksum_kind
from rlbus.transfer.rendezvous import connect_store, host_store

JOINED = "shm/joined"
FORMED = "shm/formed"


def segment_name(group_name: str, generation: int) -> str:
    """A short, unique, filesystem-safe segment name derived from the group name."""
    return f"rlbus_{xxhash.xxh64_hexdigest(group_name.encode())}_{os.getpid()}_{generation}"


class _NotOpen:
    def __getattr__(self, name: str):
        raise TransferError("shm transfer group is not open")


class _Store:
    """The group's store with every wait bounded and every failure typed."""

    def __init__(self, store: dist.Store, init: TransferInit) -> None:
        self.store, self.init = store, init
        self.store.set_timeout(timedelta(seconds=init.timeout_s))

    def wait(self, key: str, what: str) -> None:
        try:
            self.store.wait([key], timedelta(seconds=self.init.timeout_s))
        except Exception as e:
            raise timeout_error(self.init, what, e) from e

    def call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise timeout_error(self.init, what, e) from e


class _Segment:
    """A mapped segment and a uint8 tensor over it."""

    def __init__(
        self, name: str, data: torch.Tensor, owner: shared_memory.SharedMemory | None, mm: mmap.mmap | None
    ) -> None:
        self.name, self.data, self._owner, self._mm = name, data, owner, mm

    @classmethod
    def create(cls, name: str, nbytes: int) -> _Segment:
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
        return cls(name, torch.frombuffer(shm.buf, dtype=torch.uint8), shm, None)

    @classmethod
    def attach(cls, name: str) -> _Segment:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, torch.frombuffer(mm, dtype=torch.uint8), None, mm)

    def close(self) -> None:
        """Unmap; the creating side also unlinks."""
        self.data = torch.empty(0, dtype=torch.uint8)  # release the buffer export first
        try:
            if self._owner is not None:
                self._owner.close()
                self._owner.unlink()
            elif self._mm is not None:
                self._mm.close()
        except (BufferError, FileNotFoundError, OSError):
            pass
        self._owner = self._mm = None


class ShmTrainer:
    """Rank 0 of a shared-memory group: writes buckets into a two-slot segment.

    A :class:`~rlbus.transfer.base.SharedMemoryTrainer` (it has :meth:`alloc`)."""

    device = torch.device("cpu")

    def __init__(self, slot_bytes: int = 0) -> None:
        self.checksum_kind = checksum_kind("shm")
        self._slot_hint = slot_bytes
        self._store: _Store | _NotOpen = _NotOpen()
        self._raw: dist.TCPStore | None = None
        self._init: TransferInit | None = None
        self._seg: _Segment | None = None
        self._slot = 0
        self._gen = 0
        self._seq = 0
        self._acked: set[int] = set()
        self._workers = 0
        self._pools: list[_Segment] = []

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer in shared memory. Buckets sent from it are not copied into a slot:
        workers copy straight out of it (one copy per worker instead of two). It lives until
        close(); do not modify a region until the send of it was waited on."""
        assert self._init is not None, "bind() first"
        seg = _Segment.create(f"{segment_name(self._init.group_name, self._gen)}-p{len(self._pools)}", nbytes)
        self._pools.append(seg)
        return seg.data[:nbytes]

    def holds(self, buf: torch.Tensor) -> bool:
        """True when `buf` lies in this trainer's shared memory (from alloc): sending it
        announces where it lies and copies nothing."""
        return self._in_pool(buf) is not None

    def _in_pool(self, buf: torch.Tensor) -> tuple[_Segment, int] | None:
        if buf.device.type != "cpu":
            return None
        ptr = buf.data_ptr()
        for seg in self._pools:
            base = seg.data.data_ptr()
            if base <= ptr and ptr + buf.numel() <= base + seg.data.numel():
                return seg, ptr - base
        return None

    def bind(self, init: TransferInit) -> TransferInit:
        """Host the rendezvous store now (port 0 = a free one); return init with the port."""
        if self._raw is not None:
            raise TransferError("already bound; close() before binding again")
        store, self._raw, bound = host_store(init)
        self._store, self._init = _Store(store, bound), bound
        self._workers = bound.world_size - 1
        return bound

    def open(self, init: TransferInit) -> TransferInit:
        """Bind if needed, then block until every worker joined (TransferTimeout otherwise)."""
        if self._raw is None:
            self.bind(init)
        assert self._init is not None
        try:
            self._store.wait(FORMED, f"waiting for {self._workers} workers to join")
            if self._slot_hint:
                self._grow(self._slot_hint)
        except TransferError:
            self.close()
            raise
        return self._init

    def send(self, buf: torch.Tensor) -> Handle:
        """Copy ``buf`` into the next free slot and announce it.

        Blocks only while that slot's previous bucket is still being read. The
        handle's ``wait`` returns once every worker copied this bucket out.
        """
        if buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransferError("buckets travel as contiguous uint8 tensors")
        k, n = self._seq, buf.numel()
        pooled = self._in_pool(buf)
        if pooled is not None:  # already in shared memory: announce where, copy nothing
            seg, off = pooled
            self._store.call(f"announcing bucket {k}", self._store.store.set, f"shm/ready/{k}", f"{seg.name}|{off}|{n}")
            self._seq += 1
            return _Ack(self, k)
        if self._seg is None or n > self._slot:
            for j in range(max(0, k - 2), k):
                self._wait_ack(j)
            self._grow(n)
        elif k >= 2:
            self._wait_ack(k - 2)
        assert self._seg is not None
        off = (k % 2) * self._slot
        self._seg.data[off : off + n].copy_(buf)
        self._store.call(
            f"announcing bucket {k}", self._store.store.set, f"shm/ready/{k}", f"{self._seg.name}|{off}|{n}"
        )
        self._seq += 1
        return _Ack(self, k)

    def _grow(self, nbytes: int) -> None:
        if self._seg is not None and nbytes <= self._slot:
            return
        assert self._init is not None
        old, self._seg = self._seg, None
        if old is not None:
            old.close()
        self._slot = align_up(max(nbytes, 1))
        self._gen += 1
        self._seg = _Segment.create(segment_name(self._init.group_name, self._gen), 2 * self._slot)

    def _wait_ack(self, k: int) -> None:
        if k in self._acked:
            return
        self._store.wait(f"shm/acked/{k}", f"waiting for workers to read bucket {k}")
        self._acked.add(k)
        store = self._store.store
        for key in (f"shm/ready/{k}", f"shm/ack/{k}", f"shm/acked/{k}"):
            try:
                store.delete_key(key)
            except Exception:
                pass

    def close(self) -> None:
        """Unlink the segments and stop hosting the store; never waits for workers."""
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        for seg in self._pools:
            seg.close()
        self._pools = []
        self._store = _NotOpen()
        self._raw = None
        self._init = None


class _Ack:
    def __init__(self, tx: ShmTrainer, k: int) -> None:
        self._tx, self._k = tx, k

    def wait(self) -> None:
        self._tx._wait_ack(self._k)


class ShmWorker:
    """A receiving rank of a shared-memory group: copies buckets out of the segment.

    A :class:`~rlbus.transfer.base.SharedMemoryWorker` (it has :meth:`recv_view`)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.checksum_kind = checksum_kind("shm")
        self._store: _Store | _NotOpen = _NotOpen()
        self._raw: dist.TCPStore | None = None
        self._segs: dict[str, _Segment] = {}
        self._workers = 0
        self._posted: dict[int, torch.Tensor | int] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._seq = 0
        self._done = 0

    def join(self, init: TransferInit, rank: int) -> None:
        """Connect to the trainer's store and block until every worker joined."""
        if not 1 <= rank < init.world_size:
            raise TransferError(f"rank {rank} outside 1..{init.world_size - 1}")
        store, self._raw = connect_store(init)
        self._store = _Store(store, init)
        self._workers = init.world_size - 1
        try:
            if self._store.call("joining", store.add, JOINED, 1) == self._workers:
                self._store.call("joining", store.set, FORMED, "1")
            self._store.wait(FORMED, "waiting for the group to form")
        except TransferError:
            self.close()
            raise

    def recv(self, buf: torch.Tensor) -> Handle:
        """Register ``buf`` for the next bucket; the handle's ``wait`` does the copy.

        Waiting on a later handle first completes every earlier one, in order.
        """
        if buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransferError("buckets travel as contiguous uint8 tensors")
        k = self._seq
        self._posted[k] = buf
        self._seq += 1
        return _Copy(self, k)

    def recv_view(self, nbytes: int) -> ViewHandle:
        """Take the next bucket where it lies in shared memory, copying nothing: the
        handle's ``wait`` returns a uint8 view of it, readable until ``release()``, which
        tells the trainer this worker is done with it (the trainer reuses that memory only
        after every worker released it). Views complete in order with ``recv``."""
        k = self._seq
        self._posted[k] = nbytes
        self._seq += 1
        return _View(self, k)

    def _complete_through(self, k: int) -> None:
        while self._done <= k:
            self._take(self._done)
            self._done += 1

    def _take(self, k: int) -> None:
        into = self._posted.pop(k)
        want = into if isinstance(into, int) else into.numel()
        self._store.wait(f"shm/ready/{k}", f"waiting for bucket {k}")
        store = self._store.store
        raw = self._store.call(f"reading bucket {k}", store.get, f"shm/ready/{k}")
        name, off_s, n_s = raw.decode().split("|")
        off, n = int(off_s), int(n_s)
        if n != want:
            raise TransferError(f"bucket {k} has {n} bytes, the receive buffer {want}")
        seg = self._segs.get(name)
        if seg is None:
            try:
                seg = self._segs[name] = _Segment.attach(name)
            except OSError as e:
                raise TransferError(f"cannot map shared memory {name!r} (same host?): {e}") from e
        if isinstance(into, int):
            self._views[k] = seg.data[off : off + n]  # acked on release
            return
        into.copy_(seg.data[off : off + n])
        self._ack(k)

    def _ack(self, k: int) -> None:
        store = self._store.store
        if self._store.call(f"acking bucket {k}", store.add, f"shm/ack/{k}", 1) == self._workers:
            self._store.call(f"acking bucket {k}", store.set, f"shm/acked/{k}", "1")

    def close(self) -> None:
        """Unmap (never unlink) the segments and disconnect."""
        for seg in self._segs.values():
            seg.close()
        self._segs = {}
        self._posted.clear()
        self._views.clear()
        self._store = _NotOpen()
        self._raw = None


class _Copy:
    def __init__(self, rx: ShmWorker, k: int) -> None:
        self._rx, self._k = rx, k

    def wait(self) -> None:
        self._rx._complete_through(self._k)


class _View:
    """The :class:`~rlbus.transfer.base.ViewHandle` of :meth:`ShmWorker.recv_view`."""

    def __init__(self, rx: ShmWorker, k: int) -> None:
        self._rx, self._k = rx, k

    def wait(self) -> torch.Tensor:
        self._rx._complete_through(self._k)
        return self._rx._views[self._k]

    def release(self) -> None:
        if self._rx._views.pop(self._k, None) is not None:
            self._rx._ack(self._k)
