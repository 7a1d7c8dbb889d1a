"""One trainer at a time: the fleet's push lease. Two trainers (two RLClients, each its own
trainer_id) push at once; exactly one commits each round, the other is refused at once with
FAILED_PRECONDITION naming the holder, before it changes anything. A trainer that stops sending
loses the lease once it lapses, and its abandoned session with it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest
from rlbus.schemas import FleetAck, InitWeightTransfer, Subjects, UpdateMode
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.waiting import eventually
from tests.weights_helpers import MODEL, VersionEvents, assert_holds, new_version, trained

WORKERS = ["w0", "w1"]
ROUNDS = 20
PUSH_LEASE_S = 2.0
Trio = tuple[LocalFleet, RLClient, RLClient]


@asynccontextmanager
async def fleet_and_two_trainers(url: str, update_mode: UpdateMode = "staged") -> AsyncIterator[Trio]:
    p = "l" + uuid.uuid4().hex[:8]
    f = LocalFleet(url)
    await f.start_controller(
        ControllerOptions(
            subjects=Subjects(prefix=p), command_timeout_s=10.0, liveness_timeout_s=1.5, push_lease_s=PUSH_LEASE_S
        )
    )
    for wid in WORKERS:
        await f.start_worker(
            ReferenceEngine(MODEL),
            WorkerOptions(
                worker_id=wid,
                subjects=Subjects(prefix=p),
                heartbeat_s=0.2,
                weight_transfer_backend="shm",
                update_mode=update_mode,
            ),
        )
    await f.wait_for_workers(WORKERS)
    a = await RLClient.connect(url, prefix=p, timeout=30.0)
    b = await RLClient.connect(url, prefix=p, timeout=30.0)
    try:
        yield f, a, b
    finally:
        await a.close()
        await b.close()
        await f.close()


@pytest.fixture
async def two_trainers(nats_server) -> AsyncIterator[Trio]:
    async with fleet_and_two_trainers(nats_server.url) as trio:
        yield trio


async def test_two_trainers_pushing_at_once_commit_exactly_once_every_round(two_trainers):
    f, a, b = two_trainers
    wins = {a.trainer_id: 0, b.trainer_id: 0}
    async with VersionEvents(a) as events:
        for i in range(ROUNDS):
            pushed = {a.trainer_id: trained(100 + 2 * i), b.trainer_id: trained(101 + 2 * i)}

            async def push(rl: RLClient) -> object:
                try:
                    return await rl.push_weights(pushed[rl.trainer_id], new_version(f"r{i}"))
                except rlbus.RLBusError as e:
                    return e

            results = dict(zip(pushed, await asyncio.gather(push(a), push(b))))
            won = [t for t, r in results.items() if not isinstance(r, Exception)]
            assert len(won) == 1, f"round {i}: {results}"
            lost = next(r for r in results.values() if isinstance(r, Exception))
            assert isinstance(lost, rlbus.FailedPrecondition), f"round {i}: the loser failed otherwise: {lost!r}"
            wins[won[0]] += 1
            await events.wait_for(i + 1)
            assert len(events.seen) == i + 1, f"round {i}: {len(events.seen)} commits so far"
            for wid in WORKERS:
                assert_holds(f, wid, pushed[won[0]])
    assert [v.seq for v in events.seen] == list(range(events.seen[0].seq, events.seen[0].seq + ROUNDS))
    print(f"\nwins per trainer over {ROUNDS} rounds: {sorted(wins.values())}")


async def test_a_second_trainer_is_refused_before_it_moves_the_group(two_trainers):
    f, a, b = two_trainers
    await a.init_weight_transfer(timeout_s=5)
    await a.start_weight_update()
    group = f.workers["w0"].updates.init.group_name
    info = await a.server_info()
    assert info.push_lease is not None and info.push_lease.trainer_id == a.trainer_id

    with pytest.raises(rlbus.FailedPrecondition):  # the SDK sees the open session and asks nothing
        await b.init_weight_transfer(timeout_s=5)
    # sent anyway (another SDK, a race with the session's start): the controller refuses it at once, naming the holder
    theirs = msgspec.structs.replace(f.workers["w0"].updates.init, group_name="trainer-b-group")
    with anyio.fail_after(3), pytest.raises(rlbus.FailedPrecondition, match=a.trainer_id):
        await b.call(InitWeightTransfer(init_info=theirs), FleetAck)
    with pytest.raises(rlbus.FailedPrecondition, match=a.trainer_id):
        await b.abort_weight_update("not mine")
    assert all(w.updates.init.group_name == group for w in f.workers.values()), "the refused init moved the group"
    assert all(w.updates.session_id == info.session_id for w in f.workers.values())

    named = trained(7)
    await a.update_weights(named)
    version = new_version("holder")
    await a.finish_weight_update(version)
    assert (await a.server_info()).push_lease is None, "finish releases the lease"
    await b.push_weights(trained(8), new_version("next"))  # free now: the other trainer pushes
    for wid in WORKERS:
        assert_holds(f, wid, trained(8))


async def test_a_trainer_that_stops_sending_loses_the_lease_and_its_session_once_it_lapses(two_trainers):
    f, a, b = two_trainers
    await a.init_weight_transfer(timeout_s=5)
    await a.start_weight_update()
    with pytest.raises(rlbus.FailedPrecondition, match="push lease"):
        await b.start_weight_update()

    async def lapsed() -> bool:  # the controller frees the lease and aborts the session it held
        info = await b.server_info()
        return info.push_lease is None and info.session_id is None

    await eventually(lapsed, timeout=PUSH_LEASE_S + 3, what="the silent trainer's lease lapsing")
    ack = await b.push_weights(trained(9), new_version("taken-over"))  # aborts the abandoned session, takes the lease
    assert ack.weight_version is not None
    for wid in WORKERS:
        assert_holds(f, wid, trained(9))
    with pytest.raises(rlbus.Aborted, match="lapsed"):  # its session is gone, and the answer says why
        await a.finish_weight_update(new_version("too-late"))


async def test_a_push_whose_resume_is_refused_after_its_commit_says_it_committed_and_leaves_the_fleet_paused(
    nats_server, monkeypatch
):
    async with fleet_and_two_trainers(nats_server.url, update_mode="in_place") as (f, a, b):
        version, named = new_version("committed-then-refused"), trained(31)
        finish = a.push.finish

        async def finish_then_b_starts(*args, **kw):
            ack = await finish(*args, **kw)
            # a's commit stands and its lease is free: b opens a session on the paused in-place
            # fleet, so a's resume is refused (nothing uncommitted is served)
            await b.start_weight_update()
            return ack

        monkeypatch.setattr(a.push, "finish", finish_then_b_starts)
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await a.push_weights(named, version)
        assert f"push_weights committed {version} but the fleet did not resume" in err.value.message, err.value
        assert "call resume()" in err.value.message
        assert a.last_push is not None and a.last_push.committed
        assert await a.get_weight_version() == version
        assert await a.is_paused()
        for wid in WORKERS:
            assert_holds(f, wid, named)
        await b.abort_weight_update()
        await a.resume()
        assert not await a.is_paused()
