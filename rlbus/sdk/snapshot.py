"""What the trainer keeps to send deltas: the last committed bits of every tensor it sent.

One `Committed` per target (main, draft): a copy of each tensor as the fleet holds it after
the commit `seq`, in the transfer dtype. Where the copy lives (`committed_copy`): a host
tensor's on the host; a GPU tensor's in pinned host memory by default (the trainer's GPU
memory is the training's; the compare copies the base up a chunk at a time, ~25 GB/s over
PCIe), or on its GPU with ``RLBUS_DELTA_BASE=device`` when it fits (the compare then reads
both copies at HBM speed and nothing crosses PCIe; a copy that does not fit, leaving
``DEVICE_HEADROOM`` free, goes to pinned host memory instead). A session records what it sends (`Pending`:
a delta's positions and values, or a copy of a tensor sent dense) and the snapshot takes it
only when finish commits, so an aborted or failed push leaves it at the last commit: the
next delta is still taken against bits every worker holds (and a worker that does not hold
them refuses it, by its commit sequence).

A committed delta is not written onto the snapshot at the commit (that would be a pass of
scattered writes over the model, on the caller's time) but kept beside its tensor
(`Committed.unapplied`): the tensor plus its unapplied delta are the committed bits. A thread
writes them after the commit (`Committed.write_behind`), while the trainer trains and the fleet
serves, so the next push finds them written; a compare that reaches a tensor first takes its
delta and writes it itself, a slice at a time just before it reads it
(`rlbus.transfer.delta.diff_checked(..., under=...)`). Each delta is written once, by whichever
takes it, and a tensor is never read while the thread writes it (`Committed.take`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import torch

from rlbus.transfer import delta

log = logging.getLogger("rlbus.sdk.snapshot")


@dataclass
class Committed:
    """The fleet's committed bits of the tensors this client sent, as of commit `seq`."""

    seq: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> its bits as of `seq`, once its entry of `unapplied` (if any) is written onto it."""
    unapplied: dict[str, delta.Delta] = field(default_factory=dict)
    """name -> the committed delta not yet written onto `tensors[name]`; whoever takes it out
    (`take`: the writer thread, or the next compare) writes it."""
    broken: str | None = None
    """Why these are not the committed bits any more (a write that failed half-way): the next
    session goes dense."""
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False, compare=False)
    _writing: str | None = field(default=None, repr=False, compare=False)
    _writer: threading.Thread | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        with self._cond:
            pending = list(self.unapplied.values())
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + sum(d.blob.numel() for d in pending)

    def take(self, name: str) -> delta.Delta | None:
        """`name`'s unapplied delta, for the caller to write onto `tensors[name]` before it
        reads it (None: written already). Waits while the writer thread writes it."""
        with self._cond:
            while self._writing == name:
                self._cond.wait()
            return self.unapplied.pop(name, None)

    def tensor(self, name: str) -> torch.Tensor:
        """The committed bits of `name`, its unapplied delta written first."""
        d = self.take(name)
        if d is not None:
            d.apply_to(self.tensors[name])
        return self.tensors[name]

    def write_behind(self) -> None:
        """Write every unapplied delta in a thread of its own, off the caller's time (after a
        commit: the next push finds them written). A compare that gets to a tensor first takes
        its delta (`take`); `settle` waits for the thread."""
        self.settle()
        if self.unapplied:
            self._writer = threading.Thread(target=self._write_all, name="rlbus-snapshot", daemon=True)
            self._writer.start()

    def settle(self) -> None:
        """Wait until the writer thread (if any) wrote every delta it took."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write_all(self) -> None:
        while True:
            with self._cond:
                if not self.unapplied:
                    return
                name, d = next(iter(self.unapplied.items()))
                del self.unapplied[name]
                self._writing = name
            try:
                d.apply_to(self.tensors[name])
            except Exception as e:  # half-written: these are not the committed bits any more
                self.broken = f"writing the committed delta of {name!r} onto the trainer's copy failed: {e}"
                log.warning("%s; the next push goes dense", self.broken)
                return
            finally:
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()


@dataclass
class Pending:
    """What one session sent, applied to the snapshot at its commit."""

    base_seq: int | None
    """The commit its deltas were taken against (None: a dense session)."""
    deltas: dict[str, delta.Delta] = field(default_factory=dict)
    """name -> the delta sent (its encoded bytes: the smallest record of the change)."""
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> a copy of a tensor sent whole."""

    @property
    def nbytes(self) -> int:
        return sum(d.blob.numel() for d in self.deltas.values()) + sum(
            t.numel() * t.element_size() for t in self.dense.values()
        )

    def commit(self, before: Committed | None, seq: int) -> Committed:
        """The snapshot after this session committed as `seq`. A delta session updates the
        snapshot it was taken against; a dense one keeps only what it sent (the fleet may
        hold other bits of the rest: another client's or an untracked push)."""
        if before is not None:
            before.settle()
        if self.base_seq is None or before is None or before.seq != self.base_seq or before.broken:
            return Committed(seq=seq, tensors=dict(self.dense))
        for name, d in self.deltas.items():
            if name in before.unapplied:  # not compared since the last commit: cannot be, but keep its bits
                before.tensor(name)
            before.unapplied[name] = d
        for name in self.dense:
            before.unapplied.pop(name, None)
        before.tensors.update(self.dense)
        before.seq = seq
        return before


BASE_ENV = "RLBUS_DELTA_BASE"
"""``device``: keep a GPU tensor's committed copy on its GPU when it fits; else (the default)
in pinned host memory."""

DEVICE_HEADROOM = 1 << 30
"""GPU bytes left free when a committed copy is put on the device."""


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of a tensor's bits (the snapshot owns it); pinned when it comes
    from a GPU, so the device compare copies it back up asynchronously and at full speed."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.contiguous().clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def committed_copy(t: torch.Tensor) -> torch.Tensor:
    """The snapshot's copy of a tensor just sent: on its device when ``RLBUS_DELTA_BASE=device``
    asks for it and it fits (see the module's docstring), else :func:`host_copy`."""
    t = t.detach()
    if t.device.type == "cuda" and os.environ.get(BASE_ENV, "").strip().lower() == "device":
        free, _ = torch.cuda.mem_get_info(t.device)
        if t.numel() * t.element_size() + DEVICE_HEADROOM <= free:
            return t.contiguous().clone()
    return host_copy(t)
