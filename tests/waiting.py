"""Wait on a condition, never on a clock: poll a predicate under a deadline."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlbus.schemas import FleetEvent, event_decoder

T = TypeVar("T")


async def eventually(
    predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, *, interval: float = 0.005, what: str = ""
) -> T:
    """Return the first truthy value of `predicate()` (sync or async); fail once `timeout` passes.

    The interval is a poll period, not a synchronisation: the test proceeds as soon as the
    condition holds, and fails with the last value seen if it never does.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        last = value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout:g}s: {what or predicate!r} (last value: {last!r})")
        await asyncio.sleep(interval)


class FleetEvents:
    """rl.events.* as they arrive (subscribe with `cb=events.on`)."""

    def __init__(self) -> None:
        self.seen: list[FleetEvent] = []

    async def on(self, msg) -> None:
        ev = event_decoder.decode(msg.data)
        if isinstance(ev, FleetEvent):
            self.seen.append(ev)

    def of(self, kind: str, worker: str) -> list[FleetEvent]:
        return [e for e in self.seen if e.event == kind and worker in e.workers]
