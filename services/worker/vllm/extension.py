"""rlbus inside vLLM's worker process: the transfer rank, the staged bytes, their verification.

vLLM mixes this class into its worker (the `worker_extension_cls` engine argument) and the
adapter calls its `rlbus_*` methods with `AsyncLLM.collective_rpc`, on every vLLM worker process
(one per tensor-parallel rank). Each process joins rlbus's transfer group as its own rank (a
standalone group built from the trainer's TCPStore: vLLM's own groups are not touched), receives
every bucket, hashes it and keeps the tensors it carries (checkpoint names) until commit. At
commit rlbus's transfer engine (transfer.py, same process) hands them to the model's own
`load_weights` from memory, then writes them into the committed segment (segment.py).

In place (`--update-mode in_place`) the bytes land straight in the committed segment instead
(no staged copy: vLLM's weights plus one committed copy, nothing else): vLLM keeps serving
its live weights until the commit loads the segment, but an abort or a failed load after a
byte landed leaves the segment torn, and the worker dirty (withheld until a repair or a push).

A collective_rpc runs on the worker's own thread, between model steps: every call here returns
at once. Joins, receives and verifications run in threads of their own (the engine keeps
stepping), and the adapter polls them by key (`rlbus_poll`). Arguments travel as msgspec bytes.

Imported by vLLM only (through the engine argument), in its worker processes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
from rlbus.schemas import BucketMeta, ParamMeta, TensorChecksum, TransferInit, UpdateTarget

from rlbus.transfer import delta
from rlbus.transfer.base import ChecksumMismatch, TransferError, WorkerTransfer
from rlbus.transfer.buckets import as_bytes
from rlbus.transfer.checksum import ChecksumKind, checksum, checksum_kind
from rlbus.transfer.factory import worker_transfer
from rlbus.transfer.stream import group_checksum_kind, recv_buckets, sole_tensor_bytes, verify

from ..updates import release_freed_memory
from .segment import Segment

log = logging.getLogger("rlbus.worker.vllm")

MAX_NAMED = 20
_PARAMS = msgspec.msgpack.Decoder(list[ParamMeta])
_BUCKETS = msgspec.msgpack.Decoder(list[BucketMeta])
_SUMS = msgspec.msgpack.Decoder(list[TensorChecksum])
_INIT = msgspec.msgpack.Decoder(TransferInit)


class Session:
    """One update session's bytes in this process."""

    def __init__(self, session_id: str, target: UpdateTarget, in_place: bool = False) -> None:
        self.id = session_id
        self.target = target
        self.in_place = in_place
        """Received into the committed segment's tensors (`staged` stays empty)."""
        self.staged: dict[str, torch.Tensor] = {}
        """Received (and delta-built) tensors, checkpoint names: loaded at commit."""
        self.base: dict[str, torch.Tensor] = {}
        """The committed segment's tensors (in place: where the bytes land)."""
        self.deltas: dict[str, str] = {}
        """Tensors built from a delta, with the checksum of what was built."""
        self.received: set[str] = set()
        self.checksums: list[str] = []
        """What every receive hashed, bucket by bucket, in the order they arrived."""
        self.problem: str | None = None
        self.kind: ChecksumKind | None = None
        """The group's checksum algorithm (what delta results are hashed with)."""
        """A delta that did not decode: prepare refuses the session."""
        self.verified = False
        self.stopped = False
        self.phases: dict[str, float] = {}
        """Seconds spent here per phase (receive, verify, load, write): the benches print them."""

    def timed(self, phase: str, started: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - started

    def check_live(self) -> None:
        if self.stopped:
            raise TransferError(f"session {self.id} was aborted")


class _Job:
    """A blocking call in a daemon thread of its own; polled by key."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.done = False
        self.error: str | None = None
        self.result: Any = None
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
        self.done = True


class State:
    """What this process holds for rlbus (one vLLM worker per process)."""

    def __init__(self) -> None:
        self.segments: dict[str, Segment] = {}
        self.rx: WorkerTransfer | None = None
        self.group: str | None = None
        self.session: Session | None = None
        self.jobs: dict[str, _Job] = {}
        self.last_phases: dict[str, float] = {}
        """The phases of the last session that ended (committed or aborted)."""
        self.lock = threading.Lock()  # a receive thread vs the worker's thread (abort, commit)

    def start(self, key: str, fn: Callable[[], Any]) -> None:
        self.jobs = {k: j for k, j in self.jobs.items() if not j.done}  # finished ones were polled
        self.jobs[key] = _Job(fn, f"rlbus-{key}")

    def committed(self) -> None:
        """The session's load succeeded: its tensors become the committed bits."""
        s = self.session
        if s is None:
            return
        t0 = time.perf_counter()
        self.segments[s.target].write(s.staged)
        s.timed("write", t0)
        self.last_phases = s.phases
        self.session = None
        trim()


STATE = State()
"""This process's rlbus state (transfer.py reads the session it loads from here)."""


class RlbusWorkerExtension:
    """Mixed into vLLM's worker class; every name here starts with `rlbus_` (vLLM refuses
    an extension whose names clash with the worker's)."""

    rank: int  # the worker's own (its tensor-parallel rank when it is the only parallelism)

    def rlbus_attach(self, main: str, draft: str | None) -> None:
        """Map the committed segments (the folders vLLM was started from)."""
        for s in STATE.segments.values():
            s.close()
        STATE.segments = {"main": Segment(main)}
        if draft:
            STATE.segments["draft"] = Segment(draft)

    def rlbus_held(self) -> dict[str, Any]:
        """What this process holds for rlbus (status, tests, bench/memory.py)."""
        s = STATE.session
        return {
            "pid": os.getpid(),
            "group": STATE.group,
            "session": s.id if s is not None else None,
            "staged_bytes": sum(t.numel() * t.element_size() for t in s.staged.values()) if s is not None else 0,
            "staged_on": sorted({str(t.device) for t in s.staged.values()}) if s is not None else [],
            "committed_bytes": {k: seg.nbytes for k, seg in STATE.segments.items()},
            "phases": dict(s.phases if s is not None else STATE.last_phases),
        }

    def rlbus_poll(self, key: str) -> tuple[bool, str | None, Any]:
        """(done, error, result) of a job; an unknown key: done, with an error."""
        job = STATE.jobs.get(key)
        if job is None:
            return True, f"no rlbus job {key!r} in this vLLM worker (it restarted?)", None
        if job.done:
            STATE.jobs.pop(key, None)
        return job.done, job.error, job.result

    def rlbus_join(self, key: str, init_bytes: bytes, rank: int) -> None:
        """Join the group as rank `rank` + this worker's own rank, in a thread."""
        init = _INIT.decode(init_bytes)
        self.rlbus_leave(None)
        rx = worker_transfer(init.backend)
        STATE.rx, STATE.group = rx, init.group_name
        STATE.start(key, lambda: rx.join(init, rank + self.rank))

    def rlbus_leave(self, group: str | None) -> None:
        """Leave the group (`None`: whichever), at once; a receive in it fails."""
        if STATE.rx is not None and (group is None or group == STATE.group):
            STATE.rx.close()
            STATE.rx = STATE.group = None

    def rlbus_receive(
        self,
        key: str,
        session_id: str,
        target: UpdateTarget,
        params: bytes,
        buckets: bytes,
        in_place: bool = False,
        staging: str = "host",
    ) -> None:
        """Receive one update's buckets in a thread (the adapter runs one at a time, in order);
        `in_place`: into the committed segment; else staged where `staging` says (VllmOptions)."""
        metas, bucket_metas = _PARAMS.decode(params), _BUCKETS.decode(buckets)
        s = STATE.session
        if s is None or s.id != session_id:
            s = STATE.session = Session(session_id, target, in_place)
        rx = STATE.rx
        if rx is None:
            raise TransferError("this vLLM worker is in no transfer group; init_weight_transfer first")
        s.verified = False
        base = STATE.segments[target].tensors
        free = torch.cuda.mem_get_info()[0] if staging == "device" and torch.cuda.is_available() else None
        where = None if in_place else staging_device(staging, sum(b.nbytes for b in bucket_metas), free)
        STATE.start(key, lambda: receive(rx, s, metas, bucket_metas, base, where))

    def rlbus_verify(self, key: str, session_id: str, checksums: list[str], tensor_checksums: bytes) -> None:
        """Phase 1 of finish, in a thread: the job's result is why the session fails, or None."""
        s = STATE.session
        if s is None or s.id != session_id:
            raise TransferError(f"this vLLM worker holds no bytes of session {session_id}")
        sums = _SUMS.decode(tensor_checksums)
        STATE.start(key, lambda: check(s, checksums, sums))

    def rlbus_live_digest(self, key: str, target: UpdateTarget) -> None:
        """Hash the model this process computes with, in vLLM's own names and layout (its
        repacked, fused parameters and buffers), in a thread: what verify_weights compares
        between vLLM replicas. The fleet's lock keeps loads out while it runs."""
        if target != "main":
            raise TransferError("only the main model's live weights are hashed")
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        STATE.start(key, lambda: live_digest(model))

    def rlbus_perturb_live_for_tests(self) -> None:
        """Tests only: change one element of the live model behind rlbus's back (what a load
        that silently went wrong leaves), for verify_weights to find."""
        p = next(iter(self.model_runner.get_model().parameters()))  # type: ignore[attr-defined]
        with torch.no_grad():
            p.view(-1)[0] += 1

    def rlbus_abort(self, session_id: str | None) -> None:
        """Drop the session's bytes (`None`: whichever session); a receive still running stops."""
        s = STATE.session
        if s is not None and (session_id is None or s.id == session_id):
            s.stopped = True
            STATE.last_phases = s.phases
            STATE.session = None
            trim()


STAGING_HEADROOM = 512 << 20
"""GPU memory left free beside a device-staged update (vLLM's own transients at load)."""


def staging_device(asked: str, need: int, free: int | None) -> torch.device | None:
    """Where a staged update of `need` bytes waits for its commit: the current GPU when
    `asked` is "device" and it fits in `free` bytes of its memory (with STAGING_HEADROOM to
    spare); None (host memory) otherwise, said in the log when device staging was asked."""
    if asked != "device":
        return None
    if free is None or need + STAGING_HEADROOM > free:
        why = "no GPU" if free is None else f"{need >> 20} MiB + headroom > {free >> 20} MiB free"
        log.warning("staging the update in host memory, not on the device: %s", why)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def live_digest(model: torch.nn.Module) -> str:
    """xxh3-128 over (name, checksum of the bytes) of every parameter and buffer, in name order."""
    import xxhash

    h = xxhash.xxh3_128()
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0{checksum(as_bytes(t.cpu().contiguous()))}\n".encode())
    return h.hexdigest()


def trim() -> None:
    """The staged buffers' pages back to the OS (glibc keeps freed multi-MiB blocks), off this thread."""
    threading.Thread(target=release_freed_memory, name="rlbus-trim", daemon=True).start()


def receive(
    rx: WorkerTransfer,
    s: Session,
    params: Sequence[ParamMeta],
    buckets: Sequence[BucketMeta],
    base: dict[str, torch.Tensor],
    device: torch.device | None = None,
) -> None:
    """Receive every bucket straight into a buffer of its own (on `device` when given: the
    GPU, see :func:`staging_device`; else pinned host memory where CUDA is: the device copy at
    load is then asynchronous and fast), keep its tensors as views of it, build delta-encoded tensors on a copy of the committed one. In place: a bucket that is
    one tensor lands in the committed segment's tensor, the others are copied there, and a
    delta is applied there."""
    t0 = time.perf_counter()
    deltas = {m.name: m for m in params if m.encoding == "delta"}
    kind = s.kind = group_checksum_kind(rx)  # a delta's result is hashed as the trainer hashed it
    pinned = torch.cuda.is_available()
    own: set[int] = set()

    def landing(bucket: BucketMeta, metas: Sequence[ParamMeta]) -> torch.Tensor | None:
        s.check_live()
        if s.in_place:
            return sole_tensor_bytes(metas, bucket.nbytes, base)
        if device is not None:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        else:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, pin_memory=pinned)
        own.add(buf.data_ptr())
        return buf

    def sink(name: str, view: torch.Tensor) -> None:
        s.check_live()
        m = deltas.get(name)
        if s.in_place:
            if m is not None:
                try:
                    delta.write(base[name], view, m)  # refused before anything is written
                except delta.DeltaError as e:
                    s.problem = s.problem or f"undecodable delta: {e}"
                    return
                s.deltas[name] = checksum(as_bytes(base[name]), kind)
            else:
                if view.data_ptr() != base[name].data_ptr():  # not landed there already
                    base[name].copy_(view)
                s.deltas.pop(name, None)
            s.received.add(name)
            return
        if m is not None:
            out = base[name].clone()  # the committed tensor, the delta's base
            try:
                delta.write(out, view, m)  # refused before anything is written
            except delta.DeltaError as e:
                s.problem = s.problem or f"undecodable delta: {e}"
                return
            s.staged[name] = out
            s.deltas[name] = checksum(as_bytes(out), kind)
        else:
            s.staged[name] = view if view.untyped_storage().data_ptr() in own else view.clone()
            s.deltas.pop(name, None)  # sent again whole in this session
        s.received.add(name)

    s.base = base
    s.checksums.extend(recv_buckets(rx, list(params), list(buckets), sink, landing=landing))
    s.timed("receive", t0)


def check(s: Session, checksums: Sequence[str], sums: Sequence[TensorChecksum]) -> str | None:
    """Every bucket's bytes hash to the trainer's checksum, every tensor a delta built (or the
    trainer names) to the trainer's checksum of the full result; why not, or None."""
    t0 = time.perf_counter()
    try:
        return _check(s, checksums, sums)
    finally:
        s.timed("verify", t0)


def _check(s: Session, checksums: Sequence[str], sums: Sequence[TensorChecksum]) -> str | None:
    if s.problem:
        return s.problem
    want = {c.name: c.checksum for c in sums}
    if checksums or not want:
        try:
            verify(s.checksums, checksums)
        except ChecksumMismatch as e:
            return str(e)
    elif unnamed := sorted(s.received - want.keys()):  # a repair: every tensor against the manifest
        return f"the manifest does not name received tensors {unnamed[:MAX_NAMED]}"
    missing = sorted(s.deltas.keys() - want.keys())
    if missing:
        return f"no result checksum from the trainer for delta tensors {missing[:MAX_NAMED]}"
    bad = []
    held = s.base if s.in_place else s.staged  # where the received tensors are
    for name, expected in want.items():
        got = s.deltas.get(name)
        if got is None and name in s.received and name in held:  # a repair's manifest: as hash_weights hashes
            got = checksum(as_bytes(held[name]), checksum_kind())
        if got != expected:
            bad.append(name)
    if bad:
        return f"{len(bad)} tensors are not bit-identical to the trainer's after the update: {bad[:MAX_NAMED]}"
    s.verified = True
    return None
