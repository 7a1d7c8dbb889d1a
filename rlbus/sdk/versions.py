"""The version watcher: the committed version first, then every later commit, in order, from
the history JetStream KV keeps of the version key."""

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

HISTORY = 16
"""Revisions of each key the state bucket keeps (its KV `history`, set by the controller's
store): how many commits a watcher may fall behind and still yield every one."""


async def watch_versions(nc: Client, subjects: Subjects) -> AsyncIterator[VersionInfo]:
    """Yield the committed version first, then every later commit, in order, each once.

    A slow consumer misses nothing while it is fewer than HISTORY (16) commits behind: the
    watcher walks the version key's history in the state bucket, from the last revision it
    yielded. One that falls further behind continues from the oldest revision still held and
    logs a warning naming how many commits it skipped.

    Only what the state KV holds is yielded: an `rl.version` event is a hint to read KV (a
    message get, no consumer: a reader needs no right to create JetStream consumers, so it
    cannot make the server publish where it may not), and KV is read again whenever no event
    came for POLL_S, so a watcher that was disconnected, even while it was still subscribing,
    still ends on the current version."""
    js = nc.jetstream(timeout=WATCH_API_TIMEOUT_S)
    try:
        kv = await retry_transient(nc, lambda: js.key_value(subjects.kv_bucket))
    except nats.js.errors.BucketNotFoundError:
        raise Unavailable("no controller has run on this prefix yet (no state bucket)") from None
    hints = await nc.subscribe(subjects.version)  # before the first read: no commit falls between
    key = subjects.kv_subject(KvKey.VERSION)

    async def latest() -> tuple[int, VersionInfo]:
        try:
            entry = await retry_transient(nc, lambda: kv.get(KvKey.VERSION))
        except nats.js.errors.KeyNotFoundError:
            return 0, VersionInfo(version=DEFAULT_VERSION)
        return entry.revision or 0, version_decoder.decode(entry.value)

    async def after(revision: int) -> tuple[int, VersionInfo | None] | None:
        """The version key's first revision after `revision` (None: there is none yet); a
        deletion or purge comes back without a record."""
        try:
            msg = await retry_transient(
                nc, lambda: js.get_msg(subjects.kv_stream, seq=revision + 1, subject=key, next=True)
            )
        except nats.js.errors.NotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return msg.seq or revision + 1, None
        return msg.seq or revision + 1, version_decoder.decode(msg.data)

    try:
        seen, last = await latest()
        yield last
        while True:
            try:
                await hints.next_msg(timeout=POLL_S)
            except nats.errors.TimeoutError:
                pass  # idle: read KV anyway (a commit may have happened while disconnected)
            while (found := await after(seen)) is not None:
                seen, record = found
                if record is None or (record.seq, record.draft_seq) == (last.seq, last.draft_seq):
                    continue  # not a commit: a deletion, or the same record written again (a state-loss write-back)
                skipped = record.seq + record.draft_seq - last.seq - last.draft_seq - 1
                if skipped > 0:
                    log.warning(
                        "watch_versions fell behind the state bucket's history (%d commits): %d commits "
                        "before %s (seq %d) were skipped",
                        HISTORY,
                        skipped,
                        record.version,
                        record.seq,
                    )
                last = record
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
        except (
            nats.errors.TimeoutError,
            nats.js.errors.ServiceUnavailableError,
            nats.errors.ConnectionReconnectingError,
        ) as e:
            denied = [s for _, s in denials.seen[before:] if s.startswith("$js.")]
            if denied:
                raise PermissionDenied(
                    f"the NATS server denies this identity the JetStream API {denied[0]}; "
                    "check its credentials and role"
                ) from None
            if nc.is_closed:
                raise Unavailable(f"the NATS connection is closed ({e!r})") from e
            log.info("JetStream call failed while the server is away (%r); retrying", e)
            await anyio.sleep(delay)  # back-off between retries, not a wait for a condition
            delay = min(delay * 2, 1.0)
