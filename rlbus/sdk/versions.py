"""The version watcher: the committed version first, then each new one, from JetStream KV."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from rlbus.bus.connection import denials_of
from rlbus.schemas import DEFAULT_VERSION, KvKey, PermissionDenied, Subjects, Unavailable, VersionInfo, version_decoder

log = logging.getLogger("rlbus.sdk.versions")
T = TypeVar("T")

# The JetStream API timeout of the watcher's reads: a request lost in a server restart is retried soon.
WATCH_API_TIMEOUT_S = 2.0

POLL_S = 1.0
"""Without an rl.version event for this long, the watcher reads KV anyway."""


async def watch_versions(nc: Client, subjects: Subjects) -> AsyncIterator[VersionInfo]:
    """Yield the committed version first, then each new one.

    Only what the state KV holds is yielded: an `rl.version` event is a hint to read KV (a
    direct get, no consumer: a reader needs no right to create JetStream consumers, so it
    cannot make the server publish where it may not), and KV is read again whenever no event
    came for POLL_S, so a watcher that was disconnected, even while it was still subscribing,
    still ends on the current version. A record is new when its KV revision changed."""
    js = nc.jetstream(timeout=WATCH_API_TIMEOUT_S)
    try:
        kv = await retry_transient(nc, lambda: js.key_value(subjects.kv_bucket))
    except nats.js.errors.BucketNotFoundError:
        raise Unavailable("no controller has run on this prefix yet (no state bucket)") from None
    hints = await nc.subscribe(subjects.version)  # before the first read: no commit falls between

    async def read() -> tuple[int, VersionInfo]:
        try:
            entry = await retry_transient(nc, lambda: kv.get(KvKey.VERSION))
        except nats.js.errors.KeyNotFoundError:
            return 0, VersionInfo(version=DEFAULT_VERSION)
        return entry.revision or 0, version_decoder.decode(entry.value)

    try:
        seen, current = await read()
        yield current
        while True:
            try:
                await hints.next_msg(timeout=POLL_S)
            except nats.errors.TimeoutError:
                pass  # idle: read KV anyway (a commit may have happened while disconnected)
            revision, record = await read()
            if revision != seen:
                seen = revision
                yield record
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await hints.unsubscribe()
            except Exception:  # the connection is already closing
                pass


async def retry_transient(nc: Client, call: Callable[[], Awaitable[T]]) -> T:
    """Run a JetStream API call, retrying while the server is away (a restart, a reconnect):
    a long-lived watcher must outlive those. Gives up when the connection is closed, and at
    once when the server denied the call (a denial looks like a timeout to nats-py)."""
    denials = denials_of(nc)
    delay = 0.05
    while True:
        before = len(denials.seen)
        try:
            return await call()
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError,
                nats.errors.ConnectionReconnectingError) as e:
            denied = [s for _, s in denials.seen[before:] if s.startswith("$js.")]
            if denied:
                raise PermissionDenied(f"the NATS server denies this identity the JetStream API {denied[0]}; "
                                       "check its credentials and role") from None
            if nc.is_closed:
                raise Unavailable(f"the NATS connection is closed ({e!r})") from e
            log.info("JetStream call failed while the server is away (%r); retrying", e)
            await anyio.sleep(delay)  # back-off between retries, not a wait for a condition
            delay = min(delay * 2, 1.0)
