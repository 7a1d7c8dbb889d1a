"""The version watcher: the committed version first, then each new one, from JetStream KV."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.api import DeliverPolicy

from rlbus.bus.connection import denials_of
from rlbus.schemas import DEFAULT_VERSION, KvKey, PermissionDenied, Subjects, Unavailable, VersionInfo, version_decoder

log = logging.getLogger("rlbus.sdk.versions")
T = TypeVar("T")

# The JetStream API timeout of the watcher's setup: a request lost in a server restart is retried soon.
WATCH_API_TIMEOUT_S = 2.0


async def watch_versions(nc: Client, subjects: Subjects) -> AsyncIterator[VersionInfo]:
    """Yield the committed version first, then each new one. Backed by JetStream KV, so a
    subscriber that was disconnected, even while it was still subscribing, still ends on
    the current version."""
    js = nc.jetstream(timeout=WATCH_API_TIMEOUT_S)
    try:
        kv = await retry_transient(nc, lambda: js.key_value(subjects.kv_bucket))
    except nats.js.errors.BucketNotFoundError:
        raise Unavailable("no controller has run on this prefix yet (no state bucket)") from None
    # Subscribe before reading the current value, so no commit falls between the two.
    # An ordered consumer with a 1 s idle heartbeat notices a lost server within seconds
    # and resumes after the last sequence it delivered.
    sub = await retry_transient(nc, lambda: js.subscribe(
        subjects.kv_subject(KvKey.VERSION), stream=subjects.kv_stream,
        ordered_consumer=True, idle_heartbeat=1.0,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
    ))
    try:
        try:
            entry = await retry_transient(nc, lambda: kv.get(KvKey.VERSION))
            seen, current = entry.revision or 0, version_decoder.decode(entry.value)
        except nats.js.errors.KeyNotFoundError:
            seen, current = 0, VersionInfo(version=DEFAULT_VERSION)
        yield current
        async for msg in sub.messages:
            if msg.metadata.sequence.stream <= seen or not msg.data:
                continue
            seen = msg.metadata.sequence.stream
            yield version_decoder.decode(msg.data)
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await sub.unsubscribe()
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
