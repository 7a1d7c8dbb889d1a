"""Repair against real faults: the peer a repair reads from is a real worker process, SIGKILLed
the moment the controller tells it to send (before the command leaves); the repair aborts on the
receiver (nothing unverified is served) and is retried from another peer. A trainer's push that
arrives during a repair waits for it and commits on the whole fleet."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest
from rlbus.schemas import SendWeightsWorker, Subjects
from rlbus.services.controller.fleet import Stamped
from rlbus.services.controller.repair import RepairOptions
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.runners.children import spawn
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.fleet import worker_command
from tests.waiting import FleetEvents, eventually
from tests.weights_helpers import MODEL, assert_holds, new_version, trained

PROC = "a-proc"
"""Sorted first: the first peer a repair picks."""


@pytest.fixture
async def fleet(nats_server, prefix) -> AsyncIterator[tuple[LocalFleet, RLClient, subprocess.Popen, Subjects]]:
    subjects = Subjects(prefix=prefix + "rp")
    f = LocalFleet(nats_server.url)
    await f.start_controller(
        ControllerOptions(
            subjects=subjects, command_timeout_s=5.0, liveness_timeout_s=1.0, repair=RepairOptions(timeout_s=20.0)
        )
    )
    await f.start_worker(
        ReferenceEngine(MODEL),
        WorkerOptions(worker_id="b0", subjects=subjects, heartbeat_s=0.2, weight_transfer_backend="gloo"),
    )
    proc = spawn(
        worker_command(nats_server.url, subjects.prefix, PROC, "gloo", MODEL),
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    rl = await RLClient.connect(nats_server.url, prefix=subjects.prefix, timeout=30.0)
    try:
        await eventually(lambda: PROC in f.controller.registry, timeout=60, what="the worker process registered")
        yield f, rl, proc, subjects
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(20)
        await rl.close()
        await f.close()


async def _new_worker(f: LocalFleet, subjects: Subjects, wid: str, seed: int):
    return await f.start_worker(
        ReferenceEngine(msgspec.structs.replace(MODEL, seed=seed)),
        WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.2, weight_transfer_backend="gloo"),
    )


async def test_a_peer_killed_as_it_is_told_to_send_a_repair_is_replaced_by_another(fleet, monkeypatch):
    f, rl, proc, subjects = fleet
    named = trained(51)
    await rl.push_weights(named, new_version("rp"))
    events = FleetEvents()
    subs = [await rl.nc.subscribe(subjects.event(k), cb=events.on) for k in ("worker_repaired", "repair_failed")]

    fleet_send = f.controller.fleet.send

    async def kill_the_sender_as_it_is_told_to_send(build, workers=None, timeout=None):
        # The kill lands before the command leaves, whatever the load: a subscriber of the send's
        # subject ran after the peer had sent and answered (a tiny model takes ~5 ms; CI's test
        # loop was busier than that).
        if isinstance(build, Stamped) and build.command is SendWeightsWorker and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
        return await fleet_send(build, workers, timeout)

    monkeypatch.setattr(f.controller.fleet, "send", kill_the_sender_as_it_is_told_to_send)
    try:
        new = await _new_worker(f, subjects, "z-new", seed=77)
        committed = (f.controller.version.version, f.controller.version.seq)
        served_early: list[tuple[str, int]] = []
        with anyio.fail_after(30):
            while not events.of("worker_repaired", "z-new"):  # until repaired: withheld, whatever happened
                st = new.state()
                if not st.withheld and (st.weight_version, st.weight_seq) != committed:
                    served_early.append((st.weight_version, st.weight_seq))
                await anyio.sleep(0.02)  # poll period while the retry's backoff runs
        assert proc.wait(5) == -signal.SIGKILL
        assert served_early == [], "the receiver served other weights than the committed ones"
        failed = events.of("repair_failed", "z-new")
        assert failed and f"from {PROC}" in failed[0].detail, events.seen
        assert "source=b0" in events.of("worker_repaired", "z-new")[0].detail
        assert_holds(f, "z-new", named)
        st = new.state()
        assert (st.weight_version, st.weight_seq) == (f.controller.version.version, f.controller.version.seq)
        assert not st.withheld
    finally:
        for s in subs:
            await s.unsubscribe()


async def test_a_push_that_arrives_during_a_repair_commits_on_the_whole_fleet(fleet):
    f, rl, proc, subjects = fleet
    await rl.push_weights(trained(52), new_version("rp"))
    await _new_worker(f, subjects, "z-late", seed=78)  # its repair starts now
    later = trained(53)
    version = new_version("rp-during")
    ack = await rl.push_weights(later, version)  # waits for the repair (or runs first); either way the fleet ends on it
    assert sorted(w.worker_id for w in ack.workers) == sorted([PROC, "b0", "z-late"])
    for wid in ("b0", "z-late"):
        assert_holds(f, wid, later)
    assert (await rl.verify_weights(later)).ok
    info = await rl.server_info()
    assert info.weight_version == version and not any(w.behind or w.state.withheld for w in info.workers)
