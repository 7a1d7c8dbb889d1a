"""Worker faults: a worker killed mid-session, a worker too slow to prepare, a late joiner (repaired).

Each test starts a small in-process fleet (shm transfer) under a prefix of its own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import anyio
import pytest
from rlbus.schemas import FleetEvent, Subjects, event_decoder
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions, WorkerService

import rlbus
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

COMMAND_TIMEOUT_S = 2.0
LIVENESS_S = 1.0


async def _worker(f: LocalFleet, prefix: str, worker_id: str) -> WorkerService:
    """A worker with a fresh engine (version "default")."""
    return await f.start_worker(
        ReferenceEngine(MODEL),
        WorkerOptions(
            worker_id=worker_id, subjects=Subjects(prefix=prefix), heartbeat_s=0.2, weight_transfer_backend="shm"
        ),
    )


@pytest.fixture
async def make_fleet(nats_server, prefix):
    made: list[tuple[LocalFleet, RLClient]] = []

    async def make(workers: Sequence[str]) -> tuple[LocalFleet, RLClient, str]:
        p = f"{prefix}{uuid.uuid4().hex[:6]}"
        f = LocalFleet(nats_server.url)
        await f.start_controller(
            ControllerOptions(
                subjects=Subjects(prefix=p),
                command_timeout_s=COMMAND_TIMEOUT_S,
                liveness_timeout_s=LIVENESS_S,
                lease_s=1.0,
            )
        )
        for wid in workers:
            await _worker(f, p, wid)
        await f.wait_for_workers(workers)
        rl = await RLClient.connect(nats_server.url, prefix=p, timeout=20.0)
        made.append((f, rl))
        await rl.init_weight_transfer(timeout_s=5)
        return f, rl, p

    yield make
    for f, rl in made:
        await rl.close()
        await f.close()


# ---- a worker killed mid-session ---------------------------------------------------------------


async def test_a_worker_killed_mid_session_aborts_it_and_the_survivors_take_the_next_push(make_fleet):
    f, rl, _ = await make_fleet(["w0", "w1", "w2"])
    old = trained(1)
    await rl.push_weights(old, "kept")

    async with VersionEvents(rl) as events:
        await rl.start_weight_update()
        await rl.update_weights(trained(2))
        await received_everything(f)
        killed = time.monotonic()
        await f.kill(f.workers["w2"])

        assert f.controller is not None
        await eventually(lambda: "w2" not in f.controller.registry, timeout=LIVENESS_S + 3, what="w2 dropped")
        await eventually(
            lambda: all(w.updates.session_id is None for w in f.workers.values()),
            timeout=3,
            what="the open session aborted on the survivors",
        )

        async def closed() -> bool:  # the controller closes its side right after the survivors'
            return (await rl.server_info()).session_id is None

        await eventually(closed, timeout=3, what="the controller's session closed")
        assert time.monotonic() - killed < LIVENESS_S + 3
        info = await rl.server_info()
        assert sorted(w.worker_id for w in info.workers) == ["w0", "w1"]
        assert info.session_id is None and info.weight_version == "kept"
        for wid, w in f.workers.items():
            assert_holds(f, wid, old)
            assert w.book.main.version == "kept"
        replies = await generate_all(rl)
        assert tokens_of(replies) == greedy(old) and all(r.weight_version == "kept" for r in replies)
        assert await first_watched_version(rl) == "kept"

        new = trained(3)
        with anyio.fail_after(30):
            ack = await rl.push_weights(new, "after-loss")
        assert sorted(w.worker_id for w in ack.workers) == ["w0", "w1"]
        assert await events.wait_for(1) == ["after-loss"], "the aborted session must publish nothing"
    for wid in f.workers:
        assert_holds(f, wid, new)


# ---- deadlines ---------------------------------------------------------------------------------


async def test_a_worker_too_slow_to_prepare_fails_the_finish_with_deadline_exceeded_naming_it(make_fleet, monkeypatch):
    f, rl, _ = await make_fleet(["w0", "w1"])
    old = trained(11)
    await rl.push_weights(old, "before-slow")
    slow = f.workers["w1"]
    prepare = slow.updates.prepare

    async def late_prepare(session_id: str, timeout: float, checksums) -> None:
        await anyio.sleep(COMMAND_TIMEOUT_S + 1.0)  # the injected fault: a worker stuck in phase 1
        await prepare(session_id, timeout, checksums)

    monkeypatch.setattr(slow.updates, "prepare", late_prepare)
    async with VersionEvents(rl) as events:
        await rl.start_weight_update()
        await rl.update_weights(trained(12))
        started = time.monotonic()
        with pytest.raises(rlbus.DeadlineExceeded) as err:
            await rl.finish_weight_update("never-slow")
        took = time.monotonic() - started

        assert took < COMMAND_TIMEOUT_S + 1.5, f"finish took {took:.2f}s"
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert err.value.workers == ["w1"] and "w1" in err.value.message
        info = await rl.server_info()
        assert info.weight_version == "before-slow" and info.session_id is None
        for wid, w in f.workers.items():
            assert_holds(f, wid, old)
            assert w.book.main.version == "before-slow"
            assert w.updates.session_id is None
        assert await rl.get_weight_version() == "before-slow"

        monkeypatch.setattr(slow.updates, "prepare", prepare)
        new = trained(13)
        await rl.push_weights(new, "after-slow")
        assert await events.wait_for(1) == ["after-slow"]
    for wid in f.workers:
        assert_holds(f, wid, new)


# ---- a late joiner -----------------------------------------------------------------------------


async def test_a_late_joiner_takes_no_traffic_until_a_peer_repaired_it_then_a_push_includes_it(make_fleet):
    f, rl, p = await make_fleet(["w0", "w1"])
    v1 = trained(21)
    await rl.push_weights(v1, "v1")
    seen: list[FleetEvent] = []

    async def on(msg) -> None:
        ev = event_decoder.decode(msg.data)
        assert isinstance(ev, FleetEvent)
        seen.append(ev)

    subjects = Subjects(prefix=p)
    sub = await rl.nc.subscribe(subjects.event("worker_stale"), cb=on)
    sub2 = await rl.nc.subscribe(subjects.event("worker_repaired"), cb=on)
    await rl.nc.flush()
    try:
        late = await _worker(f, p, "w2")
        await f.wait_for_workers(["w2"])
        await eventually(lambda: [e for e in seen if e.event == "worker_stale"], timeout=3, what="a worker_stale event")
        assert [e.workers for e in seen if e.event == "worker_stale"] == [["w2"]]
        while late.book.withheld:  # behind: every reply comes from the others, on v1
            r = await rl.generate([1, 2, 3], 4)
            assert r.worker_id in {"w0", "w1"} and r.weight_version == "v1", "a stale worker answered generation"
        # repaired over shm from a peer, without a push (the worker serves once its commit is in: the
        # controller's event follows its answer)
        await eventually(
            lambda: [e for e in seen if e.event == "worker_repaired"], timeout=3, what="a worker_repaired event"
        )
        assert [e.workers for e in seen if e.event == "worker_repaired"] == [["w2"]]
        assert late.book.main.version == "v1"
        assert_holds(f, "w2", v1)

        v2 = trained(22)
        ack = await rl.push_weights(v2, "v2")  # the trainer's group is rebuilt to include w2
        assert sorted(w.worker_id for w in ack.workers) == ["w0", "w1", "w2"]
        assert not late.book.withheld and late.book.main.version == "v2"
        assert_holds(f, "w2", v2)
        assert not any(w.behind or w.state.withheld for w in (await rl.server_info()).workers)

        async def w2_answers() -> bool:
            r = await rl.generate([1, 2, 3], 4)
            assert r.weight_version == "v2"
            return r.worker_id == "w2"

        await eventually(w2_answers, timeout=10, interval=0, what="w2 serving generation")
    finally:
        await sub.unsubscribe()
        await sub2.unsubscribe()
