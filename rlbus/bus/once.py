"""An async call run once, its outcome shared: the first caller runs it, a concurrent one waits
for it, a later one gets the same result. One that raised is run again by the next caller (a
write the store refused is tried again by whoever needs it next)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


def once(call: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
    lock = anyio.Lock()
    result: list[T] = []

    async def run() -> T:
        async with lock:
            if not result:
                result.append(await call())
        return result[0]

    return run
