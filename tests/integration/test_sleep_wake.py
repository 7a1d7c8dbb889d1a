"""Sleep levels and tags across a fleet: what is freed, what wakes, what is refused."""

from __future__ import annotations

import asyncio

import pytest

import rlbus
from tests.fleet import LONG, PROMPTS, fleet_running, start_fleet
from tests.waiting import eventually

MODEL = LONG


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, model=MODEL) as running:
        yield running


@pytest.fixture(autouse=True)
async def awake_fleet(fleet):
    """Every test leaves the module's fleet awake, resumed and idle."""
    f, rl = fleet
    yield
    await rl.resume()
    await rl.wake_up()
    await eventually(lambda: all(w.state().in_flight == 0 for w in f.workers.values()), what="fleet idle")


async def generate_all(rl, max_tokens: int = 12) -> list[list[int]]:
    replies = await asyncio.gather(*(rl.generate(p, max_tokens) for p in PROMPTS))
    assert all(r.finish_reason == "length" for r in replies)
    return [r.tokens for r in replies]


async def test_sleep_level_1_frees_weights_and_cache_and_wake_restores_identical_generation(fleet):
    _, rl = fleet
    before = await generate_all(rl)
    sizes = {w.worker_id: (w.param_bytes, w.kv_cache_bytes) for w in (await rl.resume()).workers}
    assert all(p > 0 and kv > 0 for p, kv in sizes.values())

    asleep = await rl.sleep(level=1)
    assert [w.worker_id for w in asleep.workers] == ["w0", "w1"]
    assert all(w.param_bytes == 0 and w.kv_cache_bytes == 0 for w in asleep.workers)
    assert all(w.sleeping_tags == ["weights", "kv_cache"] and w.sleep_level == 1 for w in asleep.workers)
    assert all(w.weights_loaded for w in asleep.workers)
    assert await rl.is_sleeping()

    awake = await rl.wake_up()
    assert {w.worker_id: (w.param_bytes, w.kv_cache_bytes) for w in awake.workers} == sizes
    assert all(not w.sleeping_tags and w.sleep_level == 0 for w in awake.workers)
    assert not await rl.is_sleeping()
    assert await generate_all(rl) == before


async def test_sleep_level_2_discards_weights_and_generation_after_wake_is_refused(nats_server, prefix):
    # destroys the weights, so it gets a fleet of its own
    f, rl = await start_fleet(nats_server.url, prefix + "-l2", model=MODEL)
    try:
        asleep = await rl.sleep(level=2)
        assert all(w.param_bytes == 0 and w.sleep_level == 2 and not w.weights_loaded for w in asleep.workers)

        awake = await rl.wake_up()
        assert all(not w.sleeping_tags and not w.weights_loaded for w in awake.workers)
        assert not await rl.is_sleeping()
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.generate([1, 2, 3], 4)
        assert err.value.code == "FAILED_PRECONDITION"
    finally:
        await rl.close()
        await f.close()


async def test_sleeping_only_the_kv_cache_keeps_weights_resident(fleet):
    _, rl = fleet
    awake = await rl.resume()
    asleep = await rl.sleep(level=1, tags=["kv_cache"])
    for before, after in zip(awake.workers, asleep.workers, strict=True):
        assert after.kv_cache_bytes == 0 and after.sleeping_tags == ["kv_cache"]
        assert after.param_bytes == before.param_bytes > 0
    assert await rl.is_sleeping()


async def test_waking_only_the_weights_leaves_the_fleet_asleep_until_the_cache_wakes(fleet):
    _, rl = fleet
    await rl.sleep(level=1)

    half = await rl.wake_up(tags=["weights"])
    assert all(w.param_bytes > 0 and w.kv_cache_bytes == 0 and w.sleeping_tags == ["kv_cache"] for w in half.workers)
    assert await rl.is_sleeping()
    with pytest.raises(rlbus.FailedPrecondition):
        await rl.generate([1, 2, 3], 4)

    full = await rl.wake_up(tags=["kv_cache"])
    assert all(w.kv_cache_bytes > 0 and not w.sleeping_tags for w in full.workers)
    assert not await rl.is_sleeping()


@pytest.mark.parametrize("tags", [None, ["weights"], ["kv_cache"]])
async def test_generation_while_asleep_is_refused_with_failed_precondition(fleet, tags):
    _, rl = fleet
    await rl.sleep(level=1, tags=tags)
    for _ in range(4):  # the queue group may pick either worker; every one refuses
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.generate([1, 2, 3], 4)
        assert err.value.code == "FAILED_PRECONDITION"
    await rl.wake_up()
    assert len((await rl.generate([1, 2, 3], 4)).tokens) == 4


async def test_sleep_with_an_empty_tag_list_is_refused_as_invalid_argument(fleet):
    f, rl = fleet
    with pytest.raises(rlbus.InvalidArgument):
        await rl.sleep(level=1, tags=[])
    assert not any(w.state().sleeping_tags for w in f.workers.values())


async def test_sleep_is_refused_on_workers_started_without_sleep_mode(nats_server, prefix):
    f, rl = await start_fleet(nats_server.url, prefix + "-nosleep", ["n0", "n1"], sleep_mode=False)
    try:
        assert not (await rl.server_info()).capabilities.sleep_mode_enabled
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.sleep(level=1)
        assert "n0" in err.value.message and "n1" in err.value.message
        assert all(w.state().param_bytes > 0 and not w.state().sleeping_tags for w in f.workers.values())
    finally:
        await rl.close()
        await f.close()


async def test_sleep_while_requests_are_frozen_in_keep_mode_is_refused_and_changes_nothing(fleet):
    f, rl = fleet
    task = asyncio.create_task(rl.generate([1, 2, 3], 200, timeout=30.0))
    await eventually(lambda: sum(w.state().in_flight for w in f.workers.values()) == 1, what="request decoding")
    await rl.pause("keep")
    busy = next(w for w, svc in f.workers.items() if svc.state().in_flight)

    with pytest.raises(rlbus.FailedPrecondition) as err:
        await rl.sleep(level=1)
    assert busy in err.value.message

    # nothing changed on ANY worker: still paused, weights and cache resident, request frozen
    states = [w.state() for w in f.workers.values()]
    assert all(s.paused and s.pause_mode == "keep" for s in states), states
    assert all(s.param_bytes > 0 and s.kv_cache_bytes > 0 and not s.sleeping_tags for s in states), states
    assert not await rl.is_sleeping()
    assert not task.done()

    await rl.resume()
    reply = await asyncio.wait_for(task, 10)
    assert reply.finish_reason == "length" and len(reply.tokens) == 200
