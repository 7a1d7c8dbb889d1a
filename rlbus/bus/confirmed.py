"""A core NATS publish the server is known to have received: for an event a subscriber must
not miss when the publisher's link dies right after it (`rl.version`).

A core publish is written to the client's socket and forgotten: one written just before the
link died (a node killed, a route cut) is lost, and nats-py says nothing. The server answers a
PING only after everything sent before it on the same link, so a PONG confirms the message;
when the link was replaced before one came, the message is published again on the new link.
At least once: a message the server took just before its link died, whose PONG was lost with
it, goes out twice (subscribers that must not count twice compare the record it carries, as
the version watcher does with a commit's seq).

`ConfirmedInOrder` keeps the messages of one subject in order across a lost link: a message
goes out once the one before it is confirmed (its confirmation joined, or run, if the caller
has not awaited it yet), so one published again on the next link never lands after a later one."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from nats.aio.client import Client

from .once import once

log = logging.getLogger("rlbus.bus.confirmed")

CONFIRM_S = 1.0
"""One wait for the PONG; a link that died meanwhile never answers it (nats-py drops the
pending PINGs on a reconnect), so the wait starts over, on the next link."""

BACKOFF_S = (0.05, 0.5)
"""The first and the longest pause between attempts while the link is down (a flush then fails
at once)."""


def _link(nc: Client) -> int:
    """The link a message published now goes out on: nats-py counts a reconnect once the new
    link's CONNECT is answered, and keeps a message published while it reconnects for that link."""
    return int(nc.stats["reconnects"]) + (1 if nc.is_reconnecting else 0)


async def publish_confirmed(nc: Client, subject: str, data: bytes, patience_s: float) -> Callable[[], Awaitable[bool]]:
    """Publish now; the call returned waits until the server has the message (published again on
    the link that replaced a lost one), for up to `patience_s`. It returns False (and logs) when
    the patience ran out or the connection closed first; it never raises. Publish errors (a
    closed connection, a full reconnect buffer) raise here, as `nc.publish` does."""
    link = _link(nc)
    await nc.publish(subject, data)

    async def confirmed() -> bool:
        nonlocal link
        pause = BACKOFF_S[0]
        with anyio.move_on_after(patience_s):
            while not nc.is_closed:
                if nc.is_connected and _link(nc) != link:  # the link it went out on was lost
                    link = _link(nc)
                    await nc.publish(subject, data)
                try:
                    await nc.flush(timeout=CONFIRM_S)  # type: ignore[arg-type]  # nats-py annotates an int
                except Exception as e:  # no PONG in time, or the link is down
                    log.debug("no confirmation of %s yet (%r)", subject, e)
                    await anyio.sleep(pause)  # a back-off while the client reconnects, not a wait for a condition
                    pause = min(pause * 2, BACKOFF_S[1])
                    continue
                if _link(nc) == link:
                    return True
        log.warning("the server did not confirm the message on %s within %gs", subject, patience_s)
        return False

    return confirmed


class ConfirmedInOrder:
    """Confirmed publishes on one subject, in order: each waits for the confirmation of the one
    before it (at most the patience; in the usual case it already came, and this costs nothing)."""

    def __init__(self, nc: Client, subject: str, patience_s: float) -> None:
        self.nc, self.subject, self.patience_s = nc, subject, patience_s
        self._last: Callable[[], Awaitable[bool]] | None = None

    async def publish(self, data: bytes) -> Callable[[], Awaitable[bool]]:
        """Publish after the previous message is confirmed; the call returned confirms this one
        (see publish_confirmed), once however often it is called."""
        if self._last is not None:
            await self._last()
        self._last = confirm = once(await publish_confirmed(self.nc, self.subject, data, self.patience_s))
        return confirm
