"""Pause modes with generation requests really in flight on a two-worker fleet."""

from __future__ import annotations

import asyncio

import pytest
from rlbus.schemas import GenerateReply

from tests.fleet import LONG, PROMPTS, fleet_running
from tests.waiting import eventually

# Long enough generations that a pause lands while every request is still decoding.
MODEL = LONG
MAX_TOKENS = 200


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, model=MODEL) as running:
        yield running


@pytest.fixture(autouse=True)
async def running_fleet(fleet):
    """Every test starts and ends with a resumed fleet and no request left over."""
    f, rl = fleet
    yield
    await rl.resume()
    await eventually(lambda: in_flight(f) == 0 and waiting(f) == 0, what="fleet idle after test")


def in_flight(f) -> int:
    return sum(w.engine.status().in_flight for w in f.workers.values())


def waiting(f) -> int:
    return sum(w.engine.status().waiting for w in f.workers.values())


def generate_all(rl, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[asyncio.Task[GenerateReply]]:
    return [asyncio.create_task(rl.generate(p, max_tokens, timeout=30.0)) for p in prompts]


async def all_in_flight(f, n: int = len(PROMPTS)) -> None:
    await eventually(lambda: in_flight(f) == n, what=f"{n} requests decoding")


async def test_pause_abort_ends_in_flight_requests_with_aborted_status(fleet):
    f, rl = fleet
    tasks = generate_all(rl)
    await all_in_flight(f)

    ack = await rl.pause("abort")

    assert [w.worker_id for w in ack.workers] == ["w0", "w1"]
    assert all(w.paused and w.pause_mode == "abort" and w.in_flight == 0 for w in ack.workers)
    done, _ = await asyncio.wait(tasks, timeout=5)
    assert len(done) == len(tasks), "aborted requests must be answered at once"
    replies = [t.result() for t in tasks]
    assert all(r.finish_reason == "abort" and r.aborted for r in replies)
    assert all(len(r.tokens) < MAX_TOKENS for r in replies)


async def test_pause_wait_returns_only_after_in_flight_requests_finish(fleet):
    f, rl = fleet
    tasks = generate_all(rl)
    await all_in_flight(f)

    ack = await rl.pause("wait")

    assert all(w.paused and w.pause_mode == "wait" and w.in_flight == 0 for w in ack.workers)
    assert in_flight(f) == 0
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(r.finish_reason == "length" and len(r.tokens) == MAX_TOKENS for r in replies)


async def test_pause_wait_holds_new_requests_until_resume(fleet):
    f, rl = fleet
    await rl.pause("wait")
    late = generate_all(rl, PROMPTS[:2], max_tokens=8)
    await eventually(lambda: waiting(f) == 2, what="two requests queued behind the pause")

    assert in_flight(f) == 0 and not any(t.done() for t in late)
    assert await rl.is_paused()

    await rl.resume()
    replies = await asyncio.wait_for(asyncio.gather(*late), 10)
    assert all(r.finish_reason == "length" and len(r.tokens) == 8 for r in replies)


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_requests_sent_while_paused_start_only_after_resume(fleet, mode):
    f, rl = fleet
    await rl.pause(mode)
    late = generate_all(rl, PROMPTS[:3], max_tokens=8)
    await eventually(lambda: waiting(f) == 3, what="three requests queued behind the pause")
    assert in_flight(f) == 0 and not any(t.done() for t in late)

    await rl.resume()
    replies = await asyncio.wait_for(asyncio.gather(*late), 10)
    assert all(r.finish_reason == "length" and len(r.tokens) == 8 for r in replies)


async def test_pause_keep_freezes_requests_and_resume_completes_them_with_identical_tokens(fleet):
    f, rl = fleet
    reference = [r.tokens for r in await asyncio.gather(*generate_all(rl))]
    assert len({tuple(t) for t in reference}) > 1, "prompts must give distinct completions"

    tasks = generate_all(rl)
    await all_in_flight(f)
    ack = await rl.pause("keep")

    assert all(w.paused and w.pause_mode == "keep" for w in ack.workers)
    assert sum(w.in_flight for w in ack.workers) == len(PROMPTS), "keep returns with requests still in flight"
    # a full round trip later they are still frozen, not finished
    assert await rl.is_paused()
    assert in_flight(f) == len(PROMPTS) and not any(t.done() for t in tasks)

    await rl.resume()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(r.finish_reason == "length" for r in replies)
    assert [r.tokens for r in replies] == reference


async def test_pause_abort_after_keep_ends_the_frozen_requests(fleet):
    f, rl = fleet
    tasks = generate_all(rl)
    await all_in_flight(f)
    await rl.pause("keep")
    assert in_flight(f) == len(PROMPTS)

    ack = await rl.pause("abort")

    assert all(w.paused and w.pause_mode == "abort" and w.in_flight == 0 for w in ack.workers)
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(r.finish_reason == "abort" and len(r.tokens) < MAX_TOKENS for r in replies)


async def test_pause_and_resume_are_idempotent(fleet):
    _, rl = fleet
    assert not await rl.is_paused()

    first = await rl.pause("abort")
    second = await rl.pause("abort")
    assert all(w.paused and w.pause_mode == "abort" for w in first.workers + second.workers)
    assert await rl.is_paused()

    first = await rl.resume()
    second = await rl.resume()
    assert not any(w.paused or w.pause_mode for w in first.workers + second.workers)
    assert not await rl.is_paused()
    reply = await rl.generate([1, 2, 3], 4)
    assert reply.finish_reason == "length" and len(reply.tokens) == 4


async def test_a_second_pause_in_another_mode_keeps_the_first_mode(fleet):
    _, rl = fleet
    await rl.pause("keep")
    ack = await rl.pause("wait")
    assert all(w.paused and w.pause_mode == "keep" for w in ack.workers)
