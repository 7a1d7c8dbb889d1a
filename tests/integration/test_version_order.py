"""Versions have an order: every commit takes the next sequence number, carried on rl.version,
by get_weight_version, watch_versions, server_info and every rl.generate reply, so staleness
is a subtraction. Version strings stay free-form unless unique_versions is on."""

from __future__ import annotations

import pytest
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions

import rlbus
from tests.fleet import fleet_running
from tests.weights_helpers import MODEL, VersionEvents, trained

WORKERS = ("w0", "w1")


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, WORKERS, weight_transfer_backend="gloo", model=MODEL) as running:
        yield running


async def _watched(rl, n: int) -> list:
    agen = rl.watch_versions()
    try:
        return [await anext(agen) for _ in range(n)]
    finally:
        await agen.aclose()


async def test_versions_out_of_order_and_repeated_still_commit_in_sequence(fleet):
    f, rl = fleet
    start = (await rl.get_weight_version_info()).seq
    before = await rl.generate([1, 2, 3], 4)
    async with VersionEvents(rl) as events:
        for i, v in enumerate(["step-5", "step-3", "step-5"]):
            await rl.push_weights(trained(10 + i), v)
        await events.wait_for(3)
    assert [(e.version, e.seq) for e in events.seen] == [
        ("step-5", start + 1),
        ("step-3", start + 2),
        ("step-5", start + 3),
    ]
    info = await rl.get_weight_version_info()
    assert (info.version, info.seq) == ("step-5", start + 3)
    assert (await rl.server_info()).weight_seq == start + 3
    assert (await _watched(rl, 1))[0].seq == start + 3
    after = await rl.generate([1, 2, 3], 4)
    assert after.weight_version == "step-5" and after.weight_seq == start + 3
    assert after.weight_seq - before.weight_seq == 3, "staleness of a rollout is a subtraction"
    assert all(w.state.weight_seq == start + 3 for w in (await rl.server_info()).workers)


async def test_update_weight_version_takes_the_next_sequence(fleet):
    f, rl = fleet
    start = (await rl.get_weight_version_info()).seq
    await rl.update_weight_version("renamed")
    info = await rl.get_weight_version_info()
    assert (info.version, info.seq) == ("renamed", start + 1)
    assert (await rl.generate([1, 2], 2)).weight_seq == start + 1


async def test_a_draft_commit_orders_the_draft_without_moving_the_main_sequence(nats_server, prefix):
    async with fleet_running(
        nats_server.url,
        prefix + "-draft",
        WORKERS,
        weight_transfer_backend="gloo",
        model=MODEL,
        engine_kw={"draft_config": MODEL},
    ) as (f, rl):
        main = (await rl.get_weight_version_info()).seq
        await rl.push_weights(trained(20), "draft-1", draft=True)
        info = await rl.get_weight_version_info()
        assert (info.seq, info.draft_version, info.draft_seq) == (main, "draft-1", 1)


async def test_with_unique_versions_a_used_version_string_is_refused_and_the_session_stays_open(
    fleet, nats_server, prefix
):
    f, rl = fleet
    await f.stop(f.controller)
    await f.start_controller(
        ControllerOptions(
            subjects=Subjects(prefix=prefix), command_timeout_s=10.0, liveness_timeout_s=1.5, unique_versions=True
        )
    )
    await f.wait_for_workers(WORKERS)
    await rl.push_weights(trained(30), "unique-1")
    seq = (await rl.get_weight_version_info()).seq
    with pytest.raises(rlbus.InvalidArgument, match="'unique-1' was committed before"):
        await rl.push_weights(trained(31), "unique-1")
    assert (await rl.get_weight_version_info()).seq == seq
    assert (await rl.server_info()).session_id is None  # push_weights aborted its session
    if not rl.transfer_ready:
        await rl.init_weight_transfer()
    await rl.start_weight_update()
    await rl.update_weights(trained(32))
    with pytest.raises(rlbus.InvalidArgument):
        await rl.finish_weight_update("unique-1")
    assert (await rl.server_info()).session_id is not None, "a refused finish leaves the session open"
    await rl.finish_weight_update("unique-2")
    info = await rl.get_weight_version_info()
    assert (info.version, info.seq) == ("unique-2", seq + 1)


async def test_watch_versions_yields_every_commit_in_order_to_a_slow_consumer(fleet):
    f, rl = fleet
    agen = rl.watch_versions()
    try:
        first = await anext(agen)
        names = [f"slow-{first.seq}-{k}" for k in range(12)]
        for name in names:  # the consumer reads nothing meanwhile
            await rl.update_weight_version(name)
        got = [await anext(agen) for _ in names]
    finally:
        await agen.aclose()
    assert [v.version for v in got] == names
    assert [v.seq for v in got] == list(range(first.seq + 1, first.seq + 13))


async def test_a_consumer_further_behind_than_the_history_skips_to_the_oldest_commit_held_and_says_so(fleet, caplog):
    from rlbus.sdk.versions import HISTORY

    f, rl = fleet
    agen = rl.watch_versions()
    try:
        first = await anext(agen)
        names = [f"behind-{first.seq}-{k}" for k in range(HISTORY + 4)]
        for name in names:
            await rl.update_weight_version(name)
        got = [await anext(agen) for _ in range(HISTORY)]
    finally:
        await agen.aclose()
    assert [v.version for v in got] == names[-HISTORY:], "the last HISTORY commits, in order"
    assert "4 commits" in caplog.text and "skipped" in caplog.text
