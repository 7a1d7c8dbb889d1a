"""A loop-lag guard for fault tests (not a test file): the services of an in-process fleet
share the test's event loop, so a worker that blocks its loop stalls this ticker too.

    async with LoopLag(bound=0.3) as lag:
        ...                      # the fault
    # leaving the block fails the test if a tick ever fired more than `bound` late
"""

from __future__ import annotations

import asyncio
import gc
import time


class LoopLag:
    """Tick every `period` seconds on the running loop and keep the worst lateness seen."""

    def __init__(self, bound: float = 0.3, period: float = 0.015) -> None:
        self.bound = bound
        self.period = period
        self.max_lag = 0.0
        """The longest a tick fired after it was due, in seconds."""
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None
        self._gc_was_enabled = True

    async def _tick(self) -> None:
        due = time.perf_counter() + self.period
        while True:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            now = time.perf_counter()
            self.max_lag = max(self.max_lag, now - due)
            self.ticks += 1
            due = now + self.period

    def check(self, what: str = "") -> None:
        """Fail now if the loop stalled beyond the bound so far."""
        assert self.max_lag <= self.bound, (
            f"the event loop stalled {self.max_lag * 1000:.0f} ms (bound {self.bound * 1000:.0f} ms)"
            + (f" {what}" if what else "")
        )

    async def __aenter__(self) -> LoopLag:
        # The interpreter's automatic collections wait until the guard ends: a full one walks
        # the heap the whole suite built (torch, and vLLM once a test imported it: ~600k
        # objects), ~280 ms here, and one falling inside the guard failed it at 304 ms with
        # nothing of ours blocking the loop. Garbage is still freed by reference counts.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._task = asyncio.create_task(self._tick(), name="looplag")
        await asyncio.sleep(0)  # the first tick is scheduled before the guarded work starts
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        assert self._task is not None
        await asyncio.sleep(self.period)  # a stall at the very end still shows in one more tick
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        finally:
            if self._gc_was_enabled:
                gc.enable()
        if exc_type is None:
            self.check()
