"""A confirmed core publish (rlbus/bus/confirmed.py, used for rl.version): the server is known
to have the message, also when the link it went out on died right after it."""

from __future__ import annotations

import anyio

from rlbus.bus.confirmed import ConfirmedInOrder, publish_confirmed
from rlbus.bus.connection import connect
from tests.netfaults import Blackhole
from tests.waiting import eventually

SUBJECT = "confirmed.test.version"


async def _listening(nats_server):
    listener = await connect(nats_server.url, name="listener")
    got: list[bytes] = []
    changed = anyio.Event()

    async def on_msg(msg) -> None:
        nonlocal changed
        got.append(msg.data)
        changed.set()
        changed = anyio.Event()

    await listener.subscribe(SUBJECT, cb=on_msg)
    await listener.flush()

    async def until(n: int) -> list[bytes]:
        with anyio.fail_after(10):
            while len(got) < n:
                await changed.wait()
        return got

    return listener, got, until


async def test_a_message_published_into_a_link_that_dies_is_published_again_on_the_next(nats_server):
    listener, got, until = await _listening(nats_server)
    async with Blackhole(nats_server.port) as hole:
        publisher = await connect(hole.url, name="publisher")
        try:
            confirm = await publish_confirmed(publisher, SUBJECT, b"first", patience_s=30)
            assert await confirm()
            assert await until(1) == [b"first"]

            hole.holed = True  # the link swallows what is written to it, as a dead node's does
            confirm = await publish_confirmed(publisher, SUBJECT, b"lost-with-its-link", patience_s=30)
            hole.cut()  # the link closes: the client reconnects through the proxy
            hole.holed = False
            with anyio.fail_after(30):
                assert await confirm(), "confirmed once the message went out on the new link"

            await publisher.publish(SUBJECT, b"after")  # same link, after it: arrives after it
            assert await until(3) == [b"first", b"lost-with-its-link", b"after"], "each message exactly once"
        finally:
            await publisher.close()
            await listener.close()


async def test_a_message_the_server_never_confirms_is_reported_within_the_patience(nats_server):
    async with Blackhole(nats_server.port) as hole:
        publisher = await connect(hole.url, name="publisher")
        try:
            hole.holed = True  # silent for good: no PONG ever comes back
            confirm = await publish_confirmed(publisher, SUBJECT, b"unheard", patience_s=1.5)
            with anyio.fail_after(5):
                assert await confirm() is False
        finally:
            hole.holed = False
            await publisher.close()


async def test_a_message_published_again_on_the_next_link_still_arrives_before_the_one_after_it(nats_server):
    """The first message's confirmation runs after a reply (a finish's rl.version event). The
    next commit's event must not overtake it when the first went out into a link that died:
    the next publish waits for (or runs) the confirmation before it, so the republished first
    one arrives first."""
    listener, got, until = await _listening(nats_server)
    async with Blackhole(nats_server.port) as hole:
        publisher = await connect(hole.url, name="publisher")
        events = ConfirmedInOrder(publisher, SUBJECT, patience_s=30)
        try:
            hole.holed = True
            first = await events.publish(b"v1")  # swallowed; its confirmation not yet run
            reconnects = publisher.stats["reconnects"]
            hole.cut()
            hole.holed = False
            await eventually(
                lambda: publisher.stats["reconnects"] > reconnects and publisher.is_connected,
                timeout=30,
                what="the publisher on its next link",
            )
            with anyio.fail_after(30):
                second = await events.publish(b"v2")
                assert await second() and await first()
            assert await until(2) == [b"v1", b"v2"], "in order, each once"
        finally:
            await publisher.close()
            await listener.close()
