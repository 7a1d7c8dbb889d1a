"""Two controllers, one 3-node NATS cluster (loopback), a partition between them. Every route
between the nodes runs through a proxy that can cut it (tests/netfaults.py), so node A can be
cut off from B and C while every process keeps running.

The leader is connected to A only; the standby, the workers and the trainer to B and C. With
A cut off, the leader's state store has no quorum: it can renew nothing, so it acts on nothing
(a state-changing call that reaches it is UNAVAILABLE naming the lost quorum, and it publishes
nothing); the standby on the majority side takes the lease with a higher epoch and serves the
trainer. Once the partition heals, the old leader finds its lease taken and steps down. Every
version is published once, by one controller at a time, in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import pytest
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions, ControllerService
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.bus.connection import connect, drain
from rlbus.runners.local import LocalFleet
from rlbus.runners.natsserver import NatsCluster
from rlbus.sdk.client import RLClient
from tests.clusterfleet import Published, jetstream_formed, takes_writes
from tests.netfaults import Blackhole
from tests.waiting import eventually
from tests.weights_helpers import MODEL, new_version, trained

WORKERS = ("w0", "w1")
LEASE_S = 2.0
PATIENCE_S = 3.0


class Partitionable:
    """A cluster whose route from node i to node j goes through proxy (i, j)."""

    def __init__(self, cluster: NatsCluster, proxies: dict[tuple[int, int], Blackhole]) -> None:
        self.cluster, self.proxies = cluster, proxies

    def cut(self, node: int, cut: bool = True) -> None:
        """Cut (or heal) every route to and from `node`: a silent link, sockets open."""
        for (i, j), proxy in self.proxies.items():
            if node in (i, j):
                proxy.holed = cut


@pytest.fixture(scope="module")
async def net() -> AsyncIterator[Partitionable]:
    cluster = NatsCluster(3)
    proxies: dict[tuple[int, int], Blackhole] = {}
    try:
        for i in range(3):
            for j in range(3):
                if i != j:
                    proxies[(i, j)] = await Blackhole(cluster.route_port(j)).__aenter__()
        cluster.route_through(lambda i, j: proxies[(i, j)].url)
        cluster.start()
        await jetstream_formed(cluster.nodes[0].url)  # the leader's node: it creates the buckets
        yield Partitionable(cluster, proxies)
    finally:
        cluster.stop()
        for p in proxies.values():
            await p.__aexit__(None, None, None)


async def test_a_partitioned_leader_acts_on_nothing_and_the_standby_on_the_majority_leads(net, prefix):
    nodes = net.cluster.nodes
    a, bc = nodes[0].url, f"{nodes[1].url},{nodes[2].url}"
    subjects = Subjects(prefix=prefix)

    def options() -> ControllerOptions:
        # 3 replicas said outright: the leader is given one node's URL, and while the routes form
        # it may not yet know the others (the default counts the nodes a connection knows)
        return ControllerOptions(
            subjects=subjects,
            command_timeout_s=5,
            liveness_timeout_s=1.5,
            lease_s=LEASE_S,
            state_patience_s=PATIENCE_S,
            state_replicas=3,
        )

    leading = LocalFleet(a)  # the leader: on A alone
    leader = await leading.start_controller(options())
    fleet = LocalFleet(bc)  # the workers: on the majority side
    for wid in WORKERS:
        await fleet.start_worker(
            ReferenceEngine(MODEL),
            WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.25, weight_transfer_backend="shm"),
        )
    await leader.wait_for(lambda reg: all(w in reg for w in WORKERS))
    standby_nc = await connect(bc, name="rlbus-controller-standby")
    standby = ControllerService(standby_nc, options())
    standing = asyncio.create_task(standby.run())
    rl = await RLClient.connect(bc, prefix=prefix, timeout=60.0)
    rl_a = await RLClient.connect(a, prefix=prefix, timeout=30.0)  # a trainer stuck on the minority side
    try:
        await eventually(lambda: standby.standby_for == leader.id, timeout=20, what="the second controller in standby")
        async with Published(nodes[1].url, subjects.version) as on_b, Published(a, subjects.version) as on_a:
            v1 = new_version("before-partition")
            first = await rl.push_weights(trained(71), v1)
            assert (await rl.server_info()).controller_id == leader.id and first.epoch == leader.epoch
            await eventually(
                lambda: on_a.versions() == [v1] and on_b.versions() == [v1], timeout=5, what="v1 published"
            )

            net.cut(0)
            # the trainer on the majority side: its next push is answered by the standby, now leading
            v2 = new_version("during-partition")
            with anyio.fail_after(60):
                second = await rl.push_weights(trained(72), v2)
            info = await rl.server_info()
            assert info.controller_id == standby.id and second.epoch == standby.epoch > leader.epoch
            assert all(w.state.epoch == standby.epoch and w.state.weight_version == v2 for w in info.workers)
            # the leader cut off acts on nothing: a state-changing call that reaches it is refused
            with pytest.raises(rlbus.Unavailable) as err:
                with anyio.fail_after(30):
                    await rl_a.pause("abort")
            assert "no quorum" in err.value.message, err.value.message
            assert leader.version.version == v1, "the cut-off leader committed nothing"
            assert on_a.versions() == [v1], "nothing was published on the minority side"

            net.cut(0, cut=False)
            # healed: the old leader's next renewal finds the lease taken; it steps down
            await eventually(lambda: leader.lease_lost, timeout=30, what="the old leader stepped down")
            await eventually(lambda: leading.all_running() is False, timeout=15, what="the old leader stopped")
            for bucket in (subjects.kv_bucket, subjects.replies_bucket):  # healed, their streams catch up
                await eventually(
                    lambda bucket=bucket: takes_writes(standby_nc, bucket),
                    timeout=30,
                    interval=0.1,
                    what=f"{bucket} takes writes again",
                )
            v3 = new_version("after-partition")
            with anyio.fail_after(60):
                third = await rl.push_weights(trained(73), v3)
            assert third.epoch == standby.epoch and (await rl.server_info()).controller_id == standby.id
            await eventually(lambda: v3 in on_b.versions(), timeout=10, what="v3 published")
            assert on_b.versions() == [v1, v2, v3], "each version published once, in order"
            assert [v.seq for v in on_b.seen] == [
                first.workers[0].weight_seq,
                first.workers[0].weight_seq + 1,
                first.workers[0].weight_seq + 2,
            ]
            assert [v.epoch for v in on_b.seen] == [leader.epoch, standby.epoch, standby.epoch]
    finally:
        await rl.close()
        await rl_a.close()
        standby.stop()
        with anyio.move_on_after(15):
            await standing
        await drain(standby_nc)
        await fleet.close()
        await leading.close()
