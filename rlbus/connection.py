"""One way to open a NATS connection, for services, the SDK and the CLI."""

from __future__ import annotations

import logging
import os

import nats
from nats.aio.client import Client

log = logging.getLogger("rlbus.connection")

DEFAULT_URL = "nats://127.0.0.1:4222"
URL_ENV = "RLBUS_NATS_URL"


def resolve_url(url: str | None) -> str | None:
    """The explicit URL, else $RLBUS_NATS_URL, else None (the caller decides: embedded server or error)."""
    return url or os.environ.get(URL_ENV) or None


async def connect(url: str, *, name: str, ping_interval: float = 2.0, max_outstanding_pings: int = 2) -> Client:
    """Connect with reconnects forever and a short ping interval (a dead link shows within seconds)."""

    async def on_error(e: Exception) -> None:
        log.warning("%s: NATS error: %s", name, e)

    async def on_disconnect() -> None:
        log.info("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to NATS", name)

    return await nats.connect(
        url,
        name=name,
        ping_interval=ping_interval,
        max_outstanding_pings=max_outstanding_pings,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
