"""SyncRLClient from a plain thread, and graceful stops that still answer what is in flight."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable

import pytest
from nats.aio.msg import Msg
from nats.micro.request import Request
from rlbus.schemas import (
    HANDED_BACK_HEADER,
    RESEND_TO_HEADER,
    SENDS_AGAIN_HEADER,
    FleetAck,
    GenerateReply,
    GenerateRequest,
    Subjects,
    encode,
    generate_reply_decoder,
)

import rlbus
from rlbus.bus.faults import expect_reply
from rlbus.runners.launcher import ProcessFleet
from rlbus.sdk.client import RLClient, SyncRLClient
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


async def test_a_draining_worker_hands_back_a_request_a_pause_held_and_another_worker_runs_it(nats_server, prefix):
    """A generate that arrived while the fleet was paused waits at its worker, not started. When
    that worker stops, it hands the request back at once (the SDK's call sends it again through
    the queue group, where another worker holds it until the resume) rather than holding its
    drain for drain_timeout_s and leaving the call to its next ask (RLClient.reask_s, 10 s)."""
    f, rl = await start_fleet(nats_server.url, prefix + "-handback", ["d5", "d6"], model=MODEL, drain_timeout_s=30.0)
    stopping: asyncio.Task[None] | None = None
    try:
        await rl.pause("abort")
        task = asyncio.create_task(rl.generate([1, 2, 3], 8, timeout=20.0))
        await eventually(lambda: sum(w.engine.status().waiting for w in f.workers.values()) == 1, what="held")
        took = next(wid for wid, w in f.workers.items() if w.engine.status().waiting == 1)
        other = f.workers[next(wid for wid in f.workers if wid != took)]

        stopping = asyncio.create_task(f.stop(f.workers[took]))
        await eventually(lambda: other.engine.status().waiting == 1, timeout=5, what="handed back, held by the other")
        await asyncio.wait_for(stopping, 5)  # nothing of its own left to drain
        assert not task.done(), "still held: the fleet is paused"

        await rl.resume()
        reply = await asyncio.wait_for(task, 10)
        assert reply.worker_id == other.id and reply.finish_reason == "length" and len(reply.tokens) == 8
    finally:
        if stopping is not None:
            await asyncio.gather(stopping, return_exceptions=True)
        await rl.close()
        await f.close()


async def test_a_plain_client_gets_a_typed_unavailable_for_a_request_a_stopping_worker_never_started(
    nats_server, prefix
):
    """Without the SDK's header (Rlbus-Sends-Again) the hand-back is the answer: UNAVAILABLE,
    saying the request was not started and may be sent again."""
    subjects = Subjects(prefix=prefix + "-handback-plain")
    f, rl = await start_fleet(nats_server.url, subjects.prefix, ["d7"], model=MODEL, drain_timeout_s=30.0)
    try:
        await rl.pause("abort")
        payload = encode(GenerateRequest(prompt_tokens=[1, 2, 3], max_tokens=4, request_id="plain-1"))
        asked = asyncio.create_task(rl.nc.request(subjects.generate, payload, timeout=10))
        await eventually(lambda: f.workers["d7"].engine.status().waiting == 1, what="held")

        await asyncio.wait_for(f.stop(f.workers["d7"]), 5)

        msg = await asyncio.wait_for(asked, 5)
        with pytest.raises(rlbus.Unavailable, match="not started"):
            expect_reply(msg, "generate", GenerateReply, generate_reply_decoder)
    finally:
        await rl.close()
        await f.close()


async def test_sigterm_to_a_worker_process_holding_a_paused_request_hands_it_to_another_at_once(nats_server, prefix):
    """The process view: `rlbus worker` processes, the fleet paused, a generate held by one of
    them, SIGTERM to that one. It exits well within its drain timeout (10 s: it holds nothing
    that runs), and the other worker holds the request until the resume, then answers it."""
    p = prefix + "-handback-proc"
    shape = ["--vocab-size", "64", "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--max-seq-len", "64"]
    procs = ProcessFleet(
        nats_server.url, 2, ["--prefix", p, "--heartbeat", "0.25", *shape], ["--prefix", p, "--liveness-timeout", "1.5"]
    )
    procs.start()
    rl = await RLClient.connect(nats_server.url, prefix=p, timeout=30.0)

    stopped: set[str] = set()

    async def waiting() -> dict[str, int]:
        if not stopped:
            procs.check_alive()
        try:
            return {w.worker_id: w.state.waiting for w in (await rl.server_info()).workers}
        except rlbus.RLBusError:
            return {}

    try:
        await eventually(lambda: _count(waiting(), 2), timeout=90, interval=0.1, what="both worker processes joined")
        await rl.pause("abort")
        task = asyncio.create_task(rl.generate([1, 2, 3], 8, timeout=60.0))
        held = await eventually(lambda: _holder(waiting()), timeout=30, interval=0.05, what="held by one worker")
        other = next(wid for wid in await waiting() if wid != held)

        began = time.monotonic()
        stopped.add(held)
        procs.procs[held].send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(procs.procs[held].wait, 30)
        assert code == 0, f"the worker exited with {code}"
        assert time.monotonic() - began < 8, "its drain waited for the request it held (10 s drain timeout)"
        assert await eventually(lambda: _holder(waiting()), timeout=10, interval=0.05) == other

        await rl.resume()
        reply = await asyncio.wait_for(task, 30)
        assert reply.worker_id == other and reply.finish_reason == "length" and len(reply.tokens) == 8
    finally:
        await rl.close()
        procs.stop()


async def test_a_generate_reaching_a_worker_as_it_leaves_the_queue_group_is_handed_back_not_refused(
    nats_server, prefix, monkeypatch
):
    """A worker that stops serving (withheld, or silent too long) leaves the queue group, and a
    send can reach it on the way: it hands the request back (the SDK sends it on, through the
    queue group) rather than answer the caller with an error; a plain caller gets UNAVAILABLE
    saying it was not started."""
    f, rl = await start_fleet(nats_server.url, prefix + "-handback-leaving", ["d10"], model=MODEL)
    w = f.workers["d10"]
    monkeypatch.setattr(w, "_silent_too_long", lambda: True)  # lost its controller: not serving
    payload = encode(GenerateRequest(prompt_tokens=[1, 2, 3], max_tokens=4, request_id="leaving-1"))
    got: asyncio.Queue = asyncio.Queue()
    inbox = rl.nc.new_inbox()
    sub = await rl.nc.subscribe(inbox, cb=got.put)
    try:
        for headers in ({SENDS_AGAIN_HEADER: "1"}, None):
            # delivered as it leaves the queue group: straight to its handler
            msg = Msg(rl.nc, subject=rl.subjects.generate, reply=inbox, data=payload, headers=headers)
            await w._generate(Request(msg), again=False)
            answer = await asyncio.wait_for(got.get(), 5)
            if headers:
                assert answer.headers == {HANDED_BACK_HEADER: "1"} and answer.data == b""
            else:
                with pytest.raises(rlbus.Unavailable, match=r"not serving .*: the request was not started there"):
                    expect_reply(answer, "generate", GenerateReply, generate_reply_decoder)
        assert w.engine.status().in_flight == 0 and "leaving-1" not in w._generations
    finally:
        await sub.unsubscribe()
        await rl.close()
        await f.close()


async def _count(states: Awaitable[dict[str, int]], n: int) -> bool:
    return len(await states) == n


async def _holder(states: Awaitable[dict[str, int]]) -> str | None:
    """The one worker that holds a request, if one does."""
    holding = [wid for wid, waiting in (await states).items() if waiting == 1]
    return holding[0] if len(holding) == 1 else None


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
