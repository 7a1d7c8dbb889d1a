"""Controller faults: a controller killed mid-session, fencing of an old epoch, a standby
controller taking over (released lease and lapsed lease), a retried finish.

Each test starts a small in-process fleet (shm transfer) under a prefix of its own, so a
restarted or killed controller never leaks state into the next test.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import nats
import pytest
from rlbus.schemas import (
    FinishWeightUpdate,
    FleetAck,
    GetServerInfo,
    Nack,
    PauseWorker,
    ServerInfo,
    Subjects,
    WorkerAck,
    encode,
    reply_decoder,
)
from rlbus.services.controller.service import ControllerOptions, ControllerService
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.bus.connection import connect
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.waiting import eventually
from tests.weights_helpers import (
    MODEL,
    VersionEvents,
    assert_holds,
    first_watched_version,
    generate_all,
    greedy,
    received_everything,
    tokens_of,
    trained,
)

WORKERS = ["w0", "w1"]
COMMAND_TIMEOUT_S = 2.5
LIVENESS_S = 1.0


def _options(prefix: str, lease_s: float = 1.0) -> ControllerOptions:
    return ControllerOptions(
        subjects=Subjects(prefix=prefix),
        command_timeout_s=COMMAND_TIMEOUT_S,
        liveness_timeout_s=LIVENESS_S,
        lease_s=lease_s,
    )


async def _fleet(url: str, prefix: str, lease_s: float = 1.0) -> tuple[LocalFleet, RLClient]:
    f = LocalFleet(url)
    await f.start_controller(_options(prefix, lease_s))
    for wid in WORKERS:
        await f.start_worker(
            ReferenceEngine(MODEL),
            WorkerOptions(
                worker_id=wid, subjects=Subjects(prefix=prefix), heartbeat_s=0.2, weight_transfer_backend="shm"
            ),
        )
    await f.wait_for_workers(WORKERS)
    rl = await RLClient.connect(url, prefix=prefix, timeout=20.0)
    await rl.init_weight_transfer(timeout_s=5)
    return f, rl


@pytest.fixture
async def fleet(nats_server, prefix):
    p = f"{prefix}{uuid.uuid4().hex[:6]}"
    f, rl = await _fleet(nats_server.url, p)
    yield f, rl, p
    await rl.close()
    await f.close()


class _Standby:
    """A second controller on the fleet's prefix, run as a task outside the LocalFleet."""

    def __init__(self, url: str, options: ControllerOptions) -> None:
        self.url, self.options = url, options

    async def __aenter__(self) -> ControllerService:
        self.nc = await connect(self.url, name="rlbus-controller-standby")
        self.svc = ControllerService(self.nc, self.options)
        self.task = asyncio.create_task(self.svc.run())
        return self.svc

    async def __aexit__(self, *exc: object) -> None:
        self.svc.stop()
        await asyncio.wait_for(self.task, 15)
        await self.nc.drain()


async def _serves(rl: RLClient, controller_id: str) -> bool:
    """server_info is answered by `controller_id`, with every worker registered."""
    try:
        info = await rl.call(GetServerInfo(), ServerInfo, timeout=1.0)
    except rlbus.RLBusError:
        return False
    return info.controller_id == controller_id and sorted(w.worker_id for w in info.workers) == WORKERS


# ---- a controller killed mid-session -----------------------------------------------------------


async def test_a_controller_killed_mid_session_is_replaced_by_one_that_aborts_the_orphaned_session(fleet):
    f, rl, p = fleet
    committed, committed_named = "before-kill", trained(1)
    await rl.push_weights(committed_named, committed)
    old = f.controller
    assert old is not None
    started = await rl.start_weight_update()
    await rl.update_weights(trained(2))
    await received_everything(f)
    assert all(w.updates.session_id == started.session_id for w in f.workers.values())
    assert await old.store.session() == started.session_id  # type: ignore[union-attr]

    async with VersionEvents(rl) as events:
        await f.kill(old)
        new = await f.start_controller(_options(p))

        assert new.epoch > old.epoch, "the new controller must take a higher epoch from KV"
        assert new.version.version == committed, "the committed version is read from KV, not reset"
        assert await new.store.session() is None  # type: ignore[union-attr]
        await f.wait_for_workers(WORKERS)
        await eventually(
            lambda: all(w.updates.session_id is None for w in f.workers.values()),
            timeout=5,
            what="the orphaned session aborted on every worker",
        )
        await eventually(
            lambda: all(w.book.epoch == new.epoch for w in f.workers.values()),
            timeout=5,
            what="every worker saw the new epoch",
        )
        info = await rl.server_info()
        assert info.controller_id == new.id and info.epoch == new.epoch
        assert info.weight_version == committed and info.session_id is None
        for wid, w in f.workers.items():
            assert_holds(f, wid, committed_named)  # the orphan's staged bytes never landed
            assert w.book.main.version == committed
        assert await first_watched_version(rl) == committed
        assert await rl.get_weight_version() == committed
        assert tokens_of(await generate_all(rl)) == greedy(committed_named)

        # the trainer's SDK carries on: the next push succeeds on its first try
        after = trained(3)
        ack = await rl.push_weights(after, "after-kill")
        assert ack.weight_version == "after-kill" and ack.epoch == new.epoch
        # one publisher: a version the orphan or the restart published would arrive first
        assert await events.wait_for(1) == ["after-kill"]
    for wid in f.workers:
        assert_holds(f, wid, after)


async def test_a_push_whose_controller_is_killed_ends_with_the_fleet_resumed_by_the_next_one(fleet):
    f, rl, p = fleet
    committed = "before-push-kill"
    await rl.push_weights(trained(4), committed)
    old = f.controller
    assert old is not None
    session_open = asyncio.Event()

    async def watch() -> None:
        await eventually(lambda: old.updates.session_id is not None, timeout=20, what="the push's session open")
        session_open.set()

    watcher = asyncio.create_task(watch())
    push = asyncio.create_task(rl.push_weights(trained(5), "never"))
    await session_open.wait()
    await watcher
    await f.kill(old)  # mid-push: the push's resume() must still land, on the next controller
    new = await f.start_controller(_options(p))
    await f.wait_for_workers(WORKERS)
    outcome = await asyncio.gather(push, return_exceptions=True)
    assert isinstance(outcome[0], rlbus.RLBusError), f"a push whose controller died must fail, got {outcome[0]!r}"
    assert not await rl.is_paused(), "the fleet stayed paused after the push's controller died"
    assert not any(w.state().paused for w in f.workers.values())
    info = await rl.server_info()
    assert info.controller_id == new.id and not info.desired.paused and info.session_id is None
    assert info.weight_version == committed
    reply = await rl.generate([1, 2, 3], 2)
    assert reply.weight_version == committed


# ---- fencing -----------------------------------------------------------------------------------


async def test_a_worker_refuses_a_command_stamped_with_an_older_epoch(fleet, nats_server):
    f, rl, p = fleet
    assert f.controller is not None
    old_epoch = f.controller.epoch
    await f.stop(f.controller)
    new = await f.start_controller(_options(p))
    await f.wait_for_workers(WORKERS)
    await eventually(
        lambda: all(w.book.epoch == new.epoch for w in f.workers.values()),
        timeout=5,
        what="every worker saw the new epoch",
    )
    assert new.epoch > old_epoch
    w0 = f.workers["w0"]
    before = w0.state()

    nc = await nats.connect(nats_server.url)
    try:
        msg = await nc.request(
            Subjects(prefix=p).worker("w0", "pause"),
            encode(PauseWorker(mode="abort", epoch=old_epoch, command_id=uuid.uuid4().hex)),
            timeout=5,
        )
        reply = reply_decoder.decode(msg.data)
        assert isinstance(reply, Nack), f"a command from epoch {old_epoch} was obeyed: {reply!r}"
        assert reply.code == "FAILED_PRECONDITION"
        assert str(old_epoch) in reply.message
        assert w0.book.epoch == new.epoch, "a refused command must not move the worker's epoch"
        assert w0.state() == before
        assert not await rl.is_paused()

        # the same command stamped with the current epoch is obeyed: the refusal was the epoch
        msg = await nc.request(
            Subjects(prefix=p).worker("w0", "pause"),
            encode(PauseWorker(mode="abort", epoch=new.epoch, command_id=uuid.uuid4().hex)),
            timeout=5,
        )
        obeyed = reply_decoder.decode(msg.data)
        assert isinstance(obeyed, WorkerAck) and obeyed.state.paused
    finally:
        await nc.close()
        await rl.resume()


# ---- two controllers ---------------------------------------------------------------------------


async def test_a_standby_controller_takes_over_at_once_when_the_leader_stops_gracefully(nats_server, prefix):
    p = f"{prefix}{uuid.uuid4().hex[:6]}"
    lease_s = 4.0  # long, so that "at once" (a released lease) cannot be a lapsed one
    f, rl = await _fleet(nats_server.url, p, lease_s=lease_s)
    try:
        leader = f.controller
        assert leader is not None
        async with _Standby(nats_server.url, _options(p, lease_s)) as standby:
            await eventually(
                lambda: standby.standby_for == leader.id, timeout=5, what="the second controller in standby"
            )

            named = trained(11)
            ack = await rl.push_weights(named, "through-the-leader")
            assert ack.epoch == leader.epoch
            assert (await rl.server_info()).controller_id == leader.id
            assert standby.standby_for == leader.id and standby.epoch == 0, (
                "the standby must not act while the leader lives"
            )

            await f.stop(leader)
            stopped = time.monotonic()
            await eventually(
                lambda: _serves(rl, standby.id),
                timeout=lease_s,
                interval=0.02,
                what="the standby serving with every worker",
            )
            assert time.monotonic() - stopped < lease_s / 2, "a released lease is taken without waiting for it to lapse"

            assert standby.standby_for is None
            assert standby.epoch > leader.epoch
            info = await rl.server_info()
            assert info.epoch == standby.epoch and info.weight_version == "through-the-leader"
            await rl.push_weights(trained(12), "through-the-standby")
            assert await rl.get_weight_version() == "through-the-standby"
    finally:
        await rl.close()
        await f.close()


async def test_a_standby_controller_takes_over_a_killed_leader_once_its_lease_lapses(nats_server, prefix):
    p = f"{prefix}{uuid.uuid4().hex[:6]}"
    lease_s = 1.0
    f, rl = await _fleet(nats_server.url, p, lease_s=lease_s)
    try:
        leader = f.controller
        assert leader is not None
        await rl.push_weights(trained(21), "before-the-kill")
        async with _Standby(nats_server.url, _options(p, lease_s)) as standby:
            await eventually(
                lambda: standby.standby_for == leader.id, timeout=5, what="the second controller in standby"
            )
            assert (await rl.server_info()).controller_id == leader.id

            await f.kill(leader)
            killed = time.monotonic()
            await eventually(
                lambda: _serves(rl, standby.id),
                timeout=lease_s + 4,
                interval=0.02,
                what="the standby serving with every worker",
            )
            took = time.monotonic() - killed
            # the leader renews every lease/4: its record lapses no sooner than 3/4 of a lease after the kill
            assert took > lease_s / 2, f"took over after {took:.2f}s, before the killed leader's lease lapsed"

            assert standby.epoch > leader.epoch
            info = await rl.server_info()
            assert info.weight_version == "before-the-kill" and info.session_id is None
            await eventually(
                lambda: all(w.book.epoch == standby.epoch for w in f.workers.values()),
                timeout=5,
                what="every worker fenced to the new epoch",
            )
            ack = await rl.push_weights(trained(22), "after-takeover")
            assert ack.epoch == standby.epoch
    finally:
        await rl.close()
        await f.close()


# ---- idempotency -------------------------------------------------------------------------------


async def test_a_retried_finish_with_the_same_command_id_commits_once_and_answers_the_same(fleet):
    f, rl, _ = fleet
    named = trained(31)
    await rl.start_weight_update()
    await rl.update_weights(named)
    finish = FinishWeightUpdate(weight_version="once", checksums=rl.push.checksums, command_id=uuid.uuid4().hex)

    async with VersionEvents(rl) as events:
        first, duplicate = await asyncio.gather(rl.call(finish, FleetAck), rl.call(finish, FleetAck))
        retried = await rl.call(finish, FleetAck)

        assert first.weight_version == "once"
        assert duplicate == first and retried == first
        # a finish with a fresh id is what a non-deduplicated retry would have run: refused
        with pytest.raises(rlbus.FailedPrecondition):
            await rl.call(FinishWeightUpdate(weight_version="twice"), FleetAck)
        await rl.update_weight_version("marker")
        # in publish order: a second "once" would sit before the marker
        assert await events.wait_for(2) == ["once", "marker"]
    for wid in f.workers:
        assert_holds(f, wid, named)
