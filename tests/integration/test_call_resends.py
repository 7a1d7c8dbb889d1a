"""A call's sends after a reconnect (rlbus/bus/replies.py): they go where the service that took
the call said (RESEND_TO_HEADER), and back where the call was first sent when that service is
gone; a call that asks where to send again and was never told is never sent again through the
queue group when its re-ask gap passes. Real nats-server, a real reconnect through a TCP proxy."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from rlbus.schemas import RESEND_TO_HEADER

from rlbus.bus.connection import connect
from rlbus.bus.replies import ReplyInbox
from tests.netfaults import Blackhole
from tests.waiting import eventually

SUBJECT = "resends.test.generate"
GONE = "resends.test.generate.gone"  # the taker's own subject: nobody listens there any more


async def test_a_send_again_to_a_service_that_is_gone_goes_where_the_call_was_first_sent(nats_server):
    server = await connect(nats_server.url, name="takes-then-answers")
    deliveries: list[str] = []

    async def on_request(msg) -> None:
        deliveries.append(msg.subject)
        if len(deliveries) == 1:  # takes it, says where to send again, and is gone before answering
            await server.publish(msg.reply, b"", headers={RESEND_TO_HEADER: GONE})
        else:
            await msg.respond(b"answered")

    await server.subscribe(SUBJECT, queue="q", cb=on_request)
    await server.flush()
    async with Blackhole(nats_server.port) as hole:
        caller = await connect(hole.url, name="caller")
        try:
            inbox = ReplyInbox(caller)
            call = inbox.call()
            asked = asyncio.create_task(call.ask(SUBJECT, b"generate", 20))
            await eventually(lambda: call.resend_to == GONE, timeout=10, what="the word of where to send again")
            hole.cut()  # the caller reconnects: it sends again, to GONE (no responders), then to SUBJECT
            msg = await asyncio.wait_for(asked, 15)
            assert msg.data == b"answered"
            assert deliveries == [SUBJECT, SUBJECT]
            assert call.resend_to is None, "the word of a service that is gone is forgotten"
            call.close()
            await inbox.close()
        finally:
            await caller.close()
            await server.close()


async def test_a_call_never_told_where_to_send_again_is_not_sent_again_when_its_gap_passes(nats_server):
    """The re-ask gap (a reply lost with no reconnect) applies only where the service said it
    runs the call: through the queue group a send again would run it a second time."""
    server = await connect(nats_server.url, name="takes-and-stays-silent")
    caller = await connect(nats_server.url, name="caller")
    deliveries: list[str] = []

    async def on_request(msg) -> None:
        deliveries.append(msg.data)

    await server.subscribe(SUBJECT, queue="q", cb=on_request)
    await server.flush()
    try:
        inbox = ReplyInbox(caller)
        call = inbox.call(redirects=True, reask_s=0.05)
        with pytest.raises(nats.errors.TimeoutError):
            await call.ask(SUBJECT, b"generate", 0.6)  # a dozen gaps
        await caller.publish(SUBJECT, b"marker")  # delivered after any send of the call's
        await eventually(lambda: b"marker" in deliveries, timeout=10, what="the marker")
        assert deliveries == [b"generate", b"marker"], "sent once"
        call.close()
        await inbox.close()
    finally:
        await caller.close()
        await server.close()
