"""SyncRLClient from a plain thread, and graceful stops that still answer what is in flight."""

from __future__ import annotations

import asyncio
import time

import pytest
from rlbus.schemas import RESEND_TO_HEADER, FleetAck, GenerateReply, Subjects

import rlbus
from rlbus.sdk.client import SyncRLClient
from tests.fleet import LONG, fleet_running, start_fleet
from tests.waiting import eventually

MODEL = LONG


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, model=MODEL) as running:
        yield running


@pytest.fixture
async def sync_client(fleet, nats_server, prefix):
    # the fleet's services run on this test's loop, so the blocking client is driven from a thread
    client = await asyncio.to_thread(SyncRLClient, nats_server.url, prefix=prefix, timeout=10.0)
    yield client
    await asyncio.to_thread(client.close)


async def test_sync_client_reads_server_info_pauses_resumes_and_generates(sync_client):
    info = await asyncio.to_thread(sync_client.server_info)
    assert [w.worker_id for w in info.workers] == ["w0", "w1"]

    paused = await asyncio.to_thread(sync_client.pause, "wait")
    assert isinstance(paused, FleetAck) and all(w.paused and w.pause_mode == "wait" for w in paused.workers)
    assert await asyncio.to_thread(sync_client.is_paused)

    resumed = await asyncio.to_thread(sync_client.resume)
    assert not any(w.paused for w in resumed.workers)
    assert not await asyncio.to_thread(sync_client.is_paused)

    reply = await asyncio.to_thread(sync_client.generate, [1, 2, 3], 6)
    assert isinstance(reply, GenerateReply) and len(reply.tokens) == 6 and reply.finish_reason == "length"


async def test_sync_client_raises_the_typed_error_of_a_refusal(sync_client):
    with pytest.raises(rlbus.InvalidArgument) as err:
        await asyncio.to_thread(sync_client.generate, [1, 2, 3], 0)
    assert err.value.code == "INVALID_ARGUMENT"


async def test_sync_client_close_closes_its_connection(nats_server, prefix, fleet):
    client = await asyncio.to_thread(SyncRLClient, nats_server.url, prefix=prefix)
    nc = client.nc
    await asyncio.to_thread(client.close)
    await eventually(lambda: nc.is_closed, timeout=5, what="connection closed")


# ---- graceful stop -----------------------------------------------------------------------


async def test_graceful_stop_lets_an_in_flight_request_finish_and_reply(nats_server, prefix):
    f, rl = await start_fleet(nats_server.url, prefix + "-drain", ["d0"], model=MODEL)
    try:
        task = asyncio.create_task(rl.generate([1, 2, 3], 200, timeout=20.0))
        await eventually(lambda: f.workers["d0"].state().in_flight == 1, what="request decoding")

        await f.stop(f.workers["d0"])

        reply = await asyncio.wait_for(task, 5)
        assert reply.worker_id == "d0"
        assert reply.finish_reason == "length" and len(reply.tokens) == 200
    finally:
        await rl.close()
        await f.close()


async def test_graceful_stop_aborts_a_frozen_request_after_the_drain_timeout_and_still_replies(nats_server, prefix):
    f, rl = await start_fleet(nats_server.url, prefix + "-frozen", ["d1"], model=MODEL, drain_timeout_s=0.3)
    try:
        task = asyncio.create_task(rl.generate([1, 2, 3], 200, timeout=20.0))
        await eventually(lambda: f.workers["d1"].state().in_flight == 1, what="request decoding")
        await rl.pause("keep")

        await f.stop(f.workers["d1"])

        reply = await asyncio.wait_for(task, 5)
        assert reply.worker_id == "d1"
        assert reply.finish_reason == "abort" and len(reply.tokens) < 200
    finally:
        await rl.close()
        await f.close()


async def test_a_request_asked_again_while_its_worker_drains_is_answered_there_and_runs_nowhere_else(
    nats_server, prefix
):
    """The SDK asks a worker about its generate from time to time (RLClient.reask_s). While that
    worker drains, it still answers for the runs it drains (and starts none): the asks never go
    through the queue group, where another worker would run the request a second time, and the
    reply is the drained run's."""
    subjects = Subjects(prefix=prefix + "-reask")
    f, rl = await start_fleet(nats_server.url, subjects.prefix, ["d3", "d4"], model=MODEL, drain_timeout_s=1.0)
    rl.reask_s = 0.05
    through_group: list[bytes] = []
    words: list[float] = []

    async def sent(msg) -> None:
        through_group.append(msg.data)

    async def answered(msg) -> None:
        if not msg.data and RESEND_TO_HEADER in (msg.headers or {}):
            words.append(time.monotonic())

    # no listener on the workers' own subjects: a send there that nobody takes must say so
    spies = [await rl.nc.subscribe(subjects.generate, cb=sent)]
    try:
        task = asyncio.create_task(rl.generate([1, 2, 3], 200, timeout=20.0))
        await eventually(lambda: sum(w.state().in_flight for w in f.workers.values()) == 1, what="the request decoding")
        spies.append(await rl.nc.subscribe(rl._replies._prefix + "*", cb=answered))
        took = next(wid for wid, w in f.workers.items() if w.state().in_flight == 1)
        other = next(wid for wid in f.workers if wid != took)
        await rl.pause("keep")  # frozen where it runs

        stopping = time.monotonic()
        await f.stop(f.workers[took])  # drains for 1 s, then aborts what it froze

        reply = await asyncio.wait_for(task, 10)
        assert reply.worker_id == took and reply.finish_reason == "abort"
        assert len(through_group) == 1, "never through the queue group again"
        assert any(t > stopping for t in words), "asked while it drained, and told it runs there"
        assert f.workers[other].engine.status().waiting == 0, "no second run"
    finally:
        for spy in spies:
            await spy.unsubscribe()
        await rl.close()
        await f.close()


async def test_graceful_stop_of_the_controller_answers_a_pause_in_flight(nats_server, prefix):
    f, rl = await start_fleet(nats_server.url, prefix + "-ctl", ["d2"], model=MODEL)
    try:
        generation = asyncio.create_task(rl.generate([1, 2, 3], 200, timeout=20.0))
        await eventually(lambda: f.workers["d2"].state().in_flight == 1, what="request decoding")
        pausing = asyncio.create_task(rl.pause("wait"))
        await eventually(lambda: f.workers["d2"].state().paused, what="worker pausing")
        assert f.controller is not None

        await f.stop(f.controller)

        ack = await asyncio.wait_for(pausing, 5)
        assert [w.worker_id for w in ack.workers] == ["d2"] and ack.workers[0].in_flight == 0
        assert (await asyncio.wait_for(generation, 5)).finish_reason == "length"
    finally:
        await rl.close()
        await f.close()
