"""Losing the state bucket never bricks the fleet: a running controller writes its state back
into a recreated bucket; a controller that starts on an empty bucket takes an epoch above
every worker's fence, says the state was lost, and publishes no version until a push commits."""

from __future__ import annotations

import nats
import pytest
from rlbus.schemas import FleetEvent, KvKey, Subjects, event_decoder
from rlbus.services.controller.service import ControllerOptions

import rlbus
from tests.fleet import fleet_running
from tests.waiting import eventually
from tests.weights_helpers import MODEL, new_version, trained

WORKERS = ("w0", "w1")


@pytest.fixture
async def fleet(nats_server, prefix):
    async with fleet_running(
        nats_server.url,
        prefix + new_version("loss").replace("-", ""),
        WORKERS,
        weight_transfer_backend="gloo",
        model=MODEL,
    ) as running:
        yield running


async def _delete_bucket(url: str, subjects: Subjects) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_key_value(subjects.kv_bucket)
    finally:
        await nc.close()


async def _lost_events(rl) -> list[FleetEvent]:
    seen: list[FleetEvent] = []

    async def on(msg) -> None:
        seen.append(event_decoder.decode(msg.data))

    await rl.nc.subscribe(rl.subjects.event("state_lost"), cb=on)
    await rl.nc.flush()
    return seen


async def test_a_bucket_deleted_under_a_running_controller_is_recreated_with_its_state(fleet, nats_server):
    f, rl = fleet
    before = new_version("before-loss")
    await rl.push_weights(trained(51), before)
    epoch = f.controller.epoch
    lost = await _lost_events(rl)
    await _delete_bucket(nats_server.url, rl.subjects)

    after = new_version("after-loss")
    ack = await rl.push_weights(trained(52), after)  # no untyped INTERNAL: the store recovers
    assert ack.weight_version == after and ack.epoch == epoch
    await eventually(lambda: lost, what="a state_lost event")
    store = f.controller.store
    assert int((await store.get(KvKey.EPOCH))[0]) == epoch
    assert (await store.version()).version == after
    assert f.controller.standby_for is None and not f.controller.lease_lost

    # a controller started next takes a higher epoch: the workers obey it
    await f.stop(f.controller)
    new = await f.start_controller(
        ControllerOptions(subjects=rl.subjects, command_timeout_s=10.0, liveness_timeout_s=1.5)
    )
    await f.wait_for_workers(WORKERS)
    assert new.epoch > epoch
    assert (await rl.push_weights(trained(53), new_version("next"))).epoch == new.epoch


async def test_a_controller_started_on_a_lost_bucket_takes_an_epoch_above_the_workers(fleet, nats_server):
    f, rl = fleet
    committed = new_version("lost")
    await rl.push_weights(trained(61), committed)
    seq = (await rl.get_weight_version_info()).seq
    old_epoch = f.controller.epoch
    await f.stop(f.controller)
    await _delete_bucket(nats_server.url, rl.subjects)
    lost = await _lost_events(rl)

    new = await f.start_controller(
        ControllerOptions(subjects=rl.subjects, command_timeout_s=10.0, liveness_timeout_s=1.5)
    )
    await f.wait_for_workers(WORKERS)
    assert new.epoch > old_epoch, "the epoch went backwards: every command would be fenced out"
    await eventually(lambda: lost, what="a state_lost event")
    assert "lost" in lost[0].detail
    await rl.pause("abort")  # the workers obey the new controller
    await rl.resume()

    with pytest.raises(rlbus.FailedPrecondition, match="state was lost"):
        await rl.update_weight_version("guess")  # no version is published until a push commits
    with pytest.raises(rlbus.Unavailable):
        await rl.generate([1, 2, 3], 2, timeout=2)  # nobody serves weights the controller cannot name

    again = new_version("recommitted")
    await rl.push_weights(trained(62), again)
    info = await rl.get_weight_version_info()
    assert info.version == again and info.seq > seq, "the sequence never goes backwards either"
    reply = await rl.generate([1, 2, 3], 2)
    assert reply.weight_version == again
