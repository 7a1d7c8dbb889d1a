"""Host buffers kept from push to push for the blobs a delta encode writes.

Written into fresh memory, every page of a blob faults and is zeroed by the kernel before the
compare can write it (a VM pays more: the host backs the page too). Buffers of 16 MiB and more
come fresh from the OS each time (glibc maps them, and unmaps them when freed), and a trainer
that trims its heap between steps hands back the rest. Measured (2026-12-07, the encode
alone: 1 GiB bf16 in 520 tensors, 1.15 % changed, 8 groups on two threads, alternated): after
a heap trim 238-283 ms (CPU 390-425) with fresh buffers, 175-179 (CPU 299-317) with these;
without a trim both ~170-190.

A buffer is lent as a tensor over a numpy view of it. Every blob written into it is a view of
that tensor, and the tensor's storage holds the numpy view, so the view dies with the last
blob: a weak reference to it tells when the buffer is free again, with its pages in place.
What a free buffer keeps resident is bounded (``keep_bytes``): beyond it the buffers that were
written furthest are let go.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

MIN_BYTES = 16 << 20
"""The smallest buffer made (a call's blobs are small; its room is sized for the worst case)."""

KEEP_BYTES = 256 << 20
"""Bytes a thread's free buffers may hold written (resident) between calls."""

KEEP_FREE = 64
"""Free buffers a thread keeps at most (a push lends ~4 a group, 8 groups, and the last push's
are still in use: its blobs are the snapshot's until the next commit)."""


class Arena:
    """One thread's buffers (not thread-safe: each compare thread has its own)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._bufs: list[np.ndarray] = []
        self._lent: list[weakref.ref[np.ndarray] | None] = []
        """Per buffer, the view it was last lent as (dead: free again)."""
        self._written: list[int] = []
        """Per buffer, how far into it anything was ever written (what it may hold resident)."""

    def __len__(self) -> int:
        return len(self._bufs)

    def _free(self, i: int) -> bool:
        lent = self._lent[i]
        return lent is None or lent() is None

    def lend(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` over a free buffer (the smallest that fits), or a new one."""
        fits = [i for i, b in enumerate(self._bufs) if b.size >= nbytes and self._free(i)]
        if fits:
            i = min(fits, key=lambda j: self._bufs[j].size)
        else:
            self._bufs.append(np.empty(max(nbytes, MIN_BYTES), dtype=np.uint8))
            self._lent.append(None)
            self._written.append(0)
            i = len(self._bufs) - 1
        view = self._bufs[i][:nbytes]
        self._lent[i] = weakref.ref(view)
        self._trim()
        return torch.from_numpy(view)

    def wrote(self, out: torch.Tensor, nbytes: int) -> None:
        """``nbytes`` from the start of ``out`` (a tensor :meth:`lend` returned) were written."""
        at = out.data_ptr()
        for i, b in enumerate(self._bufs):
            if b.ctypes.data == at:
                self._written[i] = max(self._written[i], min(nbytes, b.size))
                return

    def _trim(self) -> None:
        """Let go of free buffers, the furthest written first, while they hold more than
        keep_bytes or number more than KEEP_FREE."""
        free = sorted((i for i in range(len(self._bufs)) if self._free(i)), key=lambda i: self._written[i])
        held = sum(self._written[i] for i in free)
        drop = set()
        while free and (held > self.keep_bytes or len(free) > KEEP_FREE):
            i = free.pop()
            held -= self._written[i]
            drop.add(i)
        if drop:
            keep = [i for i in range(len(self._bufs)) if i not in drop]
            self._bufs = [self._bufs[i] for i in keep]
            self._lent = [self._lent[i] for i in keep]
            self._written = [self._written[i] for i in keep]
