"""Soak on a real 3-node NATS cluster (loopback): a seeded run of pushes with a random node killed
(SIGKILL) and restarted (same port, same store) — between pushes, with every byte of a push sent
and finish not yet asked, or in finish once every worker committed — mixed with clean pushes.

Every push commits exactly once or fails with a typed error; after each iteration the fleet is
in step (every worker registered and on the committed version, or withheld while behind until
the next push); at the end, the versions published on `rl.version` (as a subscriber on a node
that is never killed receives them) are exactly the successful pushes, in order, and every
worker holds the last one."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import AsyncIterator

import anyio
import pytest
from rlbus.schemas import CommitWorker

import rlbus
from rlbus.runners.local import LocalFleet
from rlbus.runners.natsserver import NatsCluster
from rlbus.sdk.client import RLClient
from tests.clusterfleet import Published, cluster_fleet, streams_current
from tests.waiting import eventually
from tests.weights_helpers import MODEL, assert_holds, trained

SEED = 20261201
WORKERS = ("c0", "c1", "c2")
SCHEDULE = {"clean": 1, "between": 2, "sent": 2, "committed": 2}
BUDGET_S = 75.0
RECONNECT = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.2}


@pytest.fixture(scope="module")
def cluster():
    with NatsCluster(3) as c:
        yield c


@pytest.fixture(scope="module")
async def fleet(cluster, prefix) -> AsyncIterator[tuple[LocalFleet, RLClient]]:
    async with cluster_fleet(
        cluster, prefix, WORKERS, "shm", trainer_timeout=60.0, command_timeout_s=5.0, liveness_timeout_s=2.0
    ) as running:
        yield running


async def test_a_seeded_run_of_pushes_and_node_kills_keeps_the_fleet_in_step(fleet, cluster, monkeypatch):
    f, rl = fleet
    assert f.controller is not None
    rng = random.Random(SEED)
    plan = [kind for kind, n in SCHEDULE.items() for _ in range(n)]
    rng.shuffle(plan)
    committed: list[str] = []
    failures: Counter[str] = Counter()
    killed_nodes: Counter[str] = Counter()
    holds = trained(MODEL.seed)
    started = time.monotonic()

    async def push(seed: int, version: str) -> bool:
        nonlocal holds
        named = trained(seed)
        before = rl.last_push
        try:
            with anyio.fail_after(60):
                await rl.push_weights(named, version)
        except rlbus.RLBusError as e:
            failures[e.code] += 1
            if rl.last_push is before or rl.last_push is None or not rl.last_push.committed:
                return False
            # the finish committed, then the resume failed (a node coming back): the error says
            # so, and the version stands
            assert f"push_weights committed {version}" in e.message, e
        committed.append(version)
        holds = named
        return True

    async def whole() -> None:
        """Every node up and its replicas current, every service connected and every worker registered."""
        await streams_current(f.controller.nc, rl.subjects)
        await eventually(
            lambda: (
                f.controller.nc.is_connected
                and all(w.nc.is_connected for w in f.workers.values())
                and all(w in f.controller.registry for w in WORKERS)
            ),
            timeout=30,
            what="every worker registered",
        )

    async def in_step(where: str) -> None:
        info = await rl.server_info()
        want = committed[-1] if committed else "default"
        assert info.weight_version == want and info.session_id is None, where
        assert sorted(w.worker_id for w in info.workers) == sorted(WORKERS), where
        for w in info.workers:
            assert w.state.session_id is None, f"{w.worker_id} {where}"
            if w.behind:  # a worker that committed what the controller never recorded: withheld
                assert w.state.withheld, f"{w.worker_id} {where}"
            else:
                assert w.state.weight_version == want, f"{w.worker_id} {where}"

    # each subscriber reconnects to its node only, for as long as it takes
    async with (
        Published(cluster.nodes[0].url, rl.subjects.version, **RECONNECT) as p0,
        Published(cluster.nodes[1].url, rl.subjects.version, **RECONNECT) as p1,
        Published(cluster.nodes[2].url, rl.subjects.version, **RECONNECT) as p2,
    ):
        for i, kind in enumerate(plan):
            seed, version = 2000 + i, f"csoak-{i}"
            await whole()
            if kind == "clean":
                await push(seed, version)
            else:
                ctl = next(n for n in cluster.nodes if n.port == f.controller.nc.connected_url.port)
                node = ctl if rng.random() < 0.5 else rng.choice([n for n in cluster.nodes if n is not ctl])
                killed_nodes["controller's" if node is ctl else "other"] += 1
                if kind == "between":
                    node.kill()
                    await push(seed, version)
                elif kind == "sent":
                    real = rl.push.finish

                    async def finish(*args, real=real, node=node, **kw):
                        node.kill()
                        return await real(*args, **kw)

                    monkeypatch.setattr(rl.push, "finish", finish)
                    await push(seed, version)
                else:  # committed: right after the workers answered Commit, before the version is recorded
                    send = f.controller.fleet.send
                    fired = anyio.Event()

                    async def send_then_kill(build, workers=None, timeout=None, send=send, node=node, fired=fired):
                        out = await send(build, workers, timeout)
                        ids = workers or f.controller.registry.ids()
                        if ids and not fired.is_set() and isinstance(build(ids[0], 0, ""), CommitWorker):
                            node.kill()
                            fired.set()
                        return out

                    monkeypatch.setattr(f.controller.fleet, "send", send_then_kill)
                    await push(seed, version)
                    assert fired.is_set()
                monkeypatch.undo()
                assert not node.running()
                node.start_again()  # same port, same store
                await whole()
            await in_step(f"after iteration {i} ({kind})")
        await whole()
        last = f"csoak-{len(plan)}"
        assert await push(3000, last), "the last push commits"
        await in_step("after the closing push")
        observers = (p0, p1, p2)

        def seen() -> list[str]:  # every version any subscriber saw, in commit order
            return [
                v.version for v in sorted({v.seq: v for p in observers for v in p.seen}.values(), key=lambda v: v.seq)
            ]

        await eventually(
            lambda: seen() == committed,
            timeout=10,
            what=f"every commit published: {committed}, seen {seen()} "
            f"(by node: {[(p.url, [(v.version, v.seq) for v in p.seen]) for p in observers]}; kills {killed_nodes}; "
            f"failures {failures})",
        )
        for p in observers:
            got = [v.version for v in p.seen]
            assert len(got) == len(set(got)) and got == [c for c in committed if c in got], f"{p.node.url}: {got}"
            assert [v.seq for v in p.seen] == sorted({v.seq for v in p.seen}), "commit sequences strictly increase"
    for wid in WORKERS:
        assert f.workers[wid].book.main.version == last
        assert_holds(f, wid, holds)
    took = time.monotonic() - started
    print(
        f"\ncluster soak (seed {SEED}): {dict(Counter(plan))}, {len(committed)} commits, failures {dict(failures)}, "
        f"nodes killed {dict(killed_nodes)}, {took:.1f}s"
    )
    assert took < BUDGET_S
