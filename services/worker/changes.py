"""Engine state changes as one condition: whoever changes the state notifies, and every waiter
re-checks its own predicate (paused, drained, restarted), so no waiter needs its own event."""

from __future__ import annotations

from collections.abc import Callable

import anyio


class Changes:
    def __init__(self) -> None:
        self._event: anyio.Event | None = None
        """What the waiters wait on; made by the first of them (most changes have no waiter,
        and an Event costs more than the change it would announce)."""

    def notify(self) -> None:
        """The state changed: wake every waiter to re-check."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Return once predicate() holds (checked now and after every notify)."""
        while not predicate():
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
