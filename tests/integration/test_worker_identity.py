"""One worker id, one live worker: a second worker with a live id is refused naming it, and
a worker restarted under the id of a dead one replaces it cleanly."""

from __future__ import annotations

import anyio
import pytest
from rlbus.schemas import Subjects
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions, WorkerService

import rlbus
from rlbus.bus.connection import connect, drain
from tests.fleet import fleet_running
from tests.waiting import eventually
from tests.weights_helpers import MODEL, new_version, trained


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(
        nats_server.url, prefix, ("w0", "w1"), weight_transfer_backend="gloo", model=MODEL
    ) as running:
        yield running


async def test_a_second_worker_with_a_live_id_is_refused_naming_the_id(fleet, nats_server, prefix):
    f, rl = fleet
    nc = await connect(nats_server.url, name="impostor-w0")
    try:
        impostor = WorkerService(
            nc,
            ReferenceEngine(MODEL),
            WorkerOptions(worker_id="w0", subjects=Subjects(prefix=prefix), weight_transfer_backend="gloo"),
        )
        with pytest.raises(rlbus.FailedPrecondition, match="'w0' is already in use"), anyio.fail_after(10):
            await impostor.run()
    finally:
        await drain(nc)
    info = await rl.server_info()
    assert [w.worker_id for w in info.workers] == ["w0", "w1"]
    acks = (await rl.pause("abort")).workers
    assert [a.worker_id for a in acks] == ["w0", "w1"]
    await rl.resume()


async def test_a_worker_restarted_under_a_dead_workers_id_replaces_it(fleet, nats_server, prefix):
    f, rl = fleet
    await f.kill(f.workers["w1"])  # its connection closes: no goodbye, no responders
    await f.start_worker(
        ReferenceEngine(MODEL),
        WorkerOptions(
            worker_id="w1", subjects=Subjects(prefix=prefix), weight_transfer_backend="gloo", heartbeat_s=0.25
        ),
    )
    await eventually(lambda: "w1" in f.controller.registry, what="the restarted w1 registered")
    version = new_version("after-restart")
    await rl.push_weights(trained(3), version)
    assert await rl.get_weight_version() == version
