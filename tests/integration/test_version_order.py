"""Versions have an order: every commit takes the next sequence number, carried on rl.version,
by get_weight_version, watch_versions, server_info and every rl.generate reply, so staleness
is a subtraction. Version strings stay free-form unless unique_versions is on."""

from __future__ import annotations

import pytest

import rlbus
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions
from tests.fleet import fleet_running
from tests.weights_helpers import MODEL, VersionEvents, trained

WORKERS = ("w0", "w1")


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, WORKERS, weight_transfer_backend="gloo", model=MODEL) as running:
        yield running


async def _watched(rl, n: int) -> list:  # noqa: ANN001
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
    assert [(e.version, e.seq) for e in events.seen] == [("step-5", start + 1), ("step-3", start + 2), ("step-5", start + 3)]
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
    async with fleet_running(nats_server.url, prefix + "-draft", WORKERS, weight_transfer_backend="gloo", model=MODEL,
                             engine_kw={"draft_config": MODEL}) as (f, rl):
        main = (await rl.get_weight_version_info()).seq
        await rl.push_weights(trained(20), "draft-1", draft=True)
        info = await rl.get_weight_version_info()
        assert (info.seq, info.draft_version, info.draft_seq) == (main, "draft-1", 1)


async def test_with_unique_versions_a_used_version_string_is_refused_and_the_session_stays_open(fleet, nats_server, prefix):
    f, rl = fleet
    await f.stop(f.controller)
    await f.start_controller(ControllerOptions(subjects=Subjects(prefix=prefix), command_timeout_s=10.0,
                                               liveness_timeout_s=1.5, unique_versions=True))
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
