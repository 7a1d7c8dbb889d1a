"""Soak: a seeded run of pushes with faults mixed in — a worker killed mid-session (and a
replacement started), a worker too slow to prepare, a corrupted bucket, clean pushes.

After every iteration the fleet must be in step: every registered worker holds the committed
weights and version, and the committed versions, as published, are exactly the successful
pushes in order (no gap, no repeat, no regression). Every failure is a typed rlbus error.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import anyio
import pytest
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.sdk.client import RLClient
from rlbus.runners.local import LocalFleet
from tests.waiting import eventually
from tests.weights_helpers import (
    MODEL,
    VersionEvents,
    assert_holds,
    send_corrupted,
    trained,
)

SEED = 20240607
COMMAND_TIMEOUT_S = 2.0
LIVENESS_S = 1.0
# how many of each iteration kind the run holds, in an order the seeded RNG shuffles
SCHEDULE = {"kill": 4, "slow": 4, "corrupt": 5, "clean": 10}
BUDGET_S = 60.0


async def _worker(f: LocalFleet, prefix: str, worker_id: str) -> None:
    await f.start_worker(
        ReferenceEngine(MODEL),
        WorkerOptions(worker_id=worker_id, subjects=Subjects(prefix=prefix), heartbeat_s=0.2, weight_transfer_backend="shm"),
    )
    await f.wait_for_workers([worker_id])


async def _group_ready(rl: RLClient) -> None:
    """A transfer group of exactly the registered workers (short collective timeout)."""
    info = await rl.server_info()
    if not rl.transfer_ready or not all(w.state.transfer_ready for w in info.workers):
        await rl.init_weight_transfer(timeout_s=5)


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    f = LocalFleet(nats_server.url)
    await f.start_controller(
        ControllerOptions(subjects=Subjects(prefix=prefix), command_timeout_s=COMMAND_TIMEOUT_S, liveness_timeout_s=LIVENESS_S, lease_s=1.0)
    )
    for wid in ("s0", "s1", "s2"):
        await _worker(f, prefix, wid)
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=20.0)
    await rl.init_weight_transfer(timeout_s=5)
    yield f, rl
    await rl.close()
    await f.close()


async def test_a_seeded_run_of_pushes_and_faults_keeps_the_fleet_in_step(fleet, prefix, monkeypatch):
    f, rl = fleet
    assert f.controller is not None
    rng = random.Random(SEED)
    plan = [kind for kind, n in SCHEDULE.items() for _ in range(n)]
    rng.shuffle(plan)
    done: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    committed: list[str] = []
    holds = trained(MODEL.seed)  # what every worker holds now
    started = time.monotonic()

    async def push(seed: int) -> None:
        nonlocal holds
        named, version = trained(seed), f"soak-{len(committed) + 1}"
        await rl.push_weights(named, version)
        committed.append(version)
        holds = named

    async def in_step(i: int, kind: str) -> None:
        want = committed[-1] if committed else "default"
        info = await rl.server_info()
        where = f"after iteration {i} ({kind})"
        assert info.weight_version == want and info.session_id is None, where
        assert sorted(w.worker_id for w in info.workers) == sorted(f.workers), where
        assert not any(w.behind for w in info.workers), where
        assert await rl.get_weight_version() == want, where
        for wid, w in f.workers.items():
            assert w.engine.weight_version == want, f"{wid} {where}"
            assert w.updates.session_id is None, f"{wid} {where}"
            assert_holds(f, wid, holds)

    async with VersionEvents(rl) as events:
        for i, kind in enumerate(plan):
            seed = 1000 + i
            if kind == "clean":
                await push(seed)
            elif kind == "corrupt":
                await _group_ready(rl)
                await rl.start_weight_update()
                await send_corrupted(rl, trained(seed), bucket_bytes=4096, bad_bucket=rng.randrange(2))
                with pytest.raises(rlbus.Aborted) as err:
                    await rl.finish_weight_update(f"never-{i}")
                assert "checksum" in err.value.message
                failures[type(err.value).__name__] += 1
            elif kind == "slow":
                victim = f.workers[rng.choice(sorted(f.workers))]
                prepare = victim.updates.prepare

                async def late_prepare(session_id: str, timeout: float, checksums, prepare=prepare) -> None:  # noqa: ANN001
                    await anyio.sleep(COMMAND_TIMEOUT_S + 0.5)  # the injected fault: stuck in phase 1
                    await prepare(session_id, timeout, checksums)

                monkeypatch.setattr(victim.updates, "prepare", late_prepare)
                with pytest.raises(rlbus.DeadlineExceeded) as err:
                    await rl.push_weights(trained(seed), f"never-{i}")
                monkeypatch.setattr(victim.updates, "prepare", prepare)
                assert err.value.workers == [victim.id]
                failures[type(err.value).__name__] += 1
            elif kind == "kill":
                await _group_ready(rl)
                victim_id = rng.choice(sorted(f.workers))
                await rl.start_weight_update()
                await rl.update_weights(trained(seed))
                await f.kill(f.workers[victim_id])
                with pytest.raises(rlbus.RLBusError) as err:
                    await rl.finish_weight_update(f"never-{i}")
                assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "FAILED_PRECONDITION")
                failures[type(err.value).__name__] += 1
                await eventually(lambda gone=victim_id: gone not in f.controller.registry, timeout=LIVENESS_S + 3,
                                 what=f"{victim_id} dropped")
                await _worker(f, prefix, f"r{i}")  # a replacement on the fresh model: stale until the next push
                assert (await rl.server_info()).session_id is None
                await push(seed + 500)  # must rebuild the group for the new membership
            done[kind] += 1
            await in_step(i, kind)

        # as published: exactly the successful pushes, in order
        assert await events.wait_for(len(committed)) == committed
        assert len(events.seen) == len(committed)

    took = time.monotonic() - started
    print(f"\nsoak (seed {SEED}): {dict(done)} iterations, {len(committed)} commits, failures raised {dict(failures)}, {took:.1f}s")
    assert done == Counter(SCHEDULE), "every scheduled fault ran"
    assert len(committed) == SCHEDULE["clean"] + SCHEDULE["kill"]
    assert sum(failures.values()) == SCHEDULE["corrupt"] + SCHEDULE["slow"] + SCHEDULE["kill"]
    assert took < BUDGET_S
