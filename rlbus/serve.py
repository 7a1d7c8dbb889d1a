"""Run one service in the foreground until SIGINT/SIGTERM, then drain it."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
from nats.aio.client import Client

from rlbus.connection import connect

log = logging.getLogger("rlbus.serve")


class Service(Protocol):
    async def run(self, *, task_status=...) -> None: ...  # noqa: ANN001

    def stop(self) -> None: ...


async def serve(url: str, name: str, make: Callable[[Client], Awaitable[Service] | Service]) -> None:
    """Connect, run the service, stop it on a signal and drain the connection."""
    nc = await connect(url, name=name)
    svc = make(nc)
    if isinstance(svc, Awaitable):
        svc = await svc
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for sig in signals:
                    log.info("%s: %s received, draining", name, signal.Signals(sig).name)
                    svc.stop()
                    return

        tg.start_soon(on_signal)
        await svc.run()
        tg.cancel_scope.cancel()
    with anyio.move_on_after(5, shield=True):
        await nc.drain()
