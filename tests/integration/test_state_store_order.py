"""A write the controller sent ahead of a reply and whose first attempt the store refused is
sent again after the reply (StateStore.put_ahead). By then the next command may have written the
same key: the session's record (the next start), the push lease (the next trainer), the decision
(the next finish). Sent again after it, the old value would undo the new one (a successor would
find the open session closed, the lease free, or the newest decision replaced by the last one).
A write superseded by a newer one to its key is not sent again.

A real nats-server refuses the first attempt: the bucket's stream is capped at the bytes it holds
(KV streams discard new messages at their limit), then uncapped."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from rlbus.services.controller.store import StateStore

from rlbus.bus.connection import connect, drain


@pytest.fixture
async def store(nats_server, prefix) -> AsyncIterator[StateStore]:
    nc = await connect(nats_server.url, name="rlbus-test-store")
    try:
        yield await StateStore.open(nc, f"{prefix}_order", replicas=1, patience_s=1.0)
    finally:
        await drain(nc)


async def capped(store: StateStore, cap: bool) -> None:
    """Make the bucket's stream refuse every new write (at its limit), or take the cap off."""
    js = store.nc.jetstream()
    stream = f"KV_{store.config.bucket}"
    info = await js.stream_info(stream)
    config = info.config
    config.max_bytes = info.state.bytes if cap else -1
    await js.update_stream(config)


async def test_a_write_refused_ahead_of_a_reply_is_not_sent_again_over_a_newer_one(store):
    await store.put("session", b"s1")
    await capped(store, True)
    old = await store.put_ahead("session", b"closed")  # the reply goes out; its store refused this
    await capped(store, False)
    await store.put("session", b"s2")  # the next command's write to the same key
    await old()  # after the reply: the refused write's retry
    value, _ = await store.get("session")
    assert value == b"s2", f"a superseded write was sent again over the newer one: {value!r}"


async def test_a_write_refused_ahead_of_a_reply_is_sent_again(store):
    await capped(store, True)
    old = await store.put_ahead("decision", b"d1")
    await capped(store, False)
    assert await old() > 0
    value, _ = await store.get("decision")
    assert value == b"d1"
    assert await old() > 0, "awaited again (a record run again after a failure), it writes again"
