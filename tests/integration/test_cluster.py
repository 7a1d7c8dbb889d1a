"""rlbus on a real 3-node NATS cluster (loopback): services given every node's URL, the state
bucket replicated on three nodes, and the node the leading controller is connected to killed
(SIGKILL) between pushes: everyone reconnects to a survivor and the next push commits once,
with the version intact."""

from __future__ import annotations

import anyio
import nats
import pytest

from rlbus.runners.natsserver import NatsCluster
from tests.fleet import fleet_running
from tests.waiting import eventually
from tests.weights_helpers import MODEL, VersionEvents, new_version, trained


@pytest.fixture(scope="module")
def cluster():  # noqa: ANN201
    with NatsCluster(3) as c:
        yield c


@pytest.fixture(scope="module")
async def fleet(cluster, prefix):
    async with fleet_running(cluster.url, prefix, ("w0", "w1"), weight_transfer_backend="gloo", model=MODEL) as running:
        yield running


async def test_the_state_bucket_is_replicated_on_three_nodes(fleet, cluster):
    f, rl = fleet
    nc = await nats.connect(cluster.url.split(","))
    try:
        info = await nc.jetstream().stream_info(rl.subjects.kv_stream)
        assert info.config.num_replicas == 3
    finally:
        await nc.close()


async def test_killing_the_controllers_node_loses_nothing(fleet, cluster):
    f, rl = fleet
    before = new_version("before-node-loss")
    await rl.push_weights(trained(81), before)
    seq = (await rl.get_weight_version_info()).seq
    port = f.controller.nc.connected_url.port
    node = next(n for n in cluster.nodes if n.port == port)
    node.kill()
    await eventually(lambda: f.controller.nc.is_connected and f.controller.nc.connected_url.port != port, timeout=15,
                     what="the controller reconnected to a surviving node")
    # a worker that was on the lost node may have been dropped while it reconnected: it rejoins
    await eventually(lambda: all(w.nc.is_connected for w in f.workers.values())
                     and all(w in f.controller.registry for w in f.workers), timeout=20,
                     what="every worker reconnected and registered")
    assert (await rl.get_weight_version_info()).version == before
    after = new_version("after-node-loss")
    async with VersionEvents(rl) as events:
        with anyio.fail_after(60):
            await rl.push_weights(trained(82), after)
        assert await events.wait_for(1) == [after]
    info = await rl.get_weight_version_info()
    assert (info.version, info.seq) == (after, seq + 1)
    assert all(w.state.weight_version == after for w in (await rl.server_info()).workers)
