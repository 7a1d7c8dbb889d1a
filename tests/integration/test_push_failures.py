"""push_weights keeps both of its promises when it fails: the fleet is left as the push found it
(resumed if the push paused it, also when the pause itself failed half-way; a fleet that was
already paused stays paused), for a failure in each phase, and `timeout` bounds the whole call,
its abort and resume included, even when the controller is SIGKILLed mid-session.

Faults are real: a worker process or a controller process SIGKILLed (the pause and transfer
phases; the deadline), a draft push to a fleet without a draft (start), tensors of the wrong
shape (update), a version string the controller refuses (finish)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from rlbus.schemas import FleetEvent, Subjects, event_decoder
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.runners.children import spawn
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import PUSH_SLACK_S, RLClient
from tests.fleet import controller_process as spawn_controller
from tests.fleet import worker_command
from tests.waiting import eventually
from tests.weights_helpers import MODEL, assert_holds, new_version, trained

PROC = "wp"
LIVENESS_S = 5.0
"""Long enough that a SIGKILLed worker is still registered when the next push starts."""


class Fleet:
    """An in-process controller and worker w0, and worker `wp` as a real process."""

    def __init__(self, f: LocalFleet, rl: RLClient, url: str, prefix: str) -> None:
        self.f, self.rl, self.url, self.prefix = f, rl, url, prefix
        self.proc: subprocess.Popen | None = None

    async def start_process(self) -> None:
        self.proc = spawn(
            worker_command(self.url, self.prefix, PROC, "gloo", MODEL),
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await eventually(self._both_serve, timeout=60, what="both workers registered and reconciled")

    async def _both_serve(self) -> bool:
        info = await self.rl.server_info()
        return {w.worker_id for w in info.workers} == {"w0", PROC} and not any(w.state.paused for w in info.workers)

    def kill_process(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    async def ensure_process(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            await eventually(
                lambda: PROC not in self.f.controller.registry, timeout=LIVENESS_S * 3, what="the killed worker dropped"
            )
            await self.start_process()


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix) -> AsyncIterator[Fleet]:
    subjects = Subjects(prefix=prefix)
    f = LocalFleet(nats_server.url)
    await f.start_controller(
        ControllerOptions(subjects=subjects, command_timeout_s=10.0, liveness_timeout_s=LIVENESS_S)
    )
    await f.start_worker(
        ReferenceEngine(MODEL),
        WorkerOptions(worker_id="w0", subjects=subjects, heartbeat_s=0.2, weight_transfer_backend="gloo"),
    )
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=20.0)
    fl = Fleet(f, rl, nats_server.url, prefix)
    try:
        await fl.start_process()
        yield fl
    finally:
        if fl.proc is not None and fl.proc.poll() is None:
            fl.proc.terminate()
            fl.proc.wait(20)
        await rl.close()
        await f.close()


@pytest.fixture
async def settled(fleet: Fleet) -> AsyncIterator[tuple[Fleet, str]]:
    """Both workers serving a committed version (the one returned) before each test."""
    await fleet.ensure_process()
    committed = new_version("kept")
    await fleet.rl.push_weights(trained(11), committed)
    yield fleet, committed


async def assert_left_as_found(fl: Fleet, committed: str, *, paused: bool = False) -> None:
    info = await fl.rl.server_info()
    assert info.session_id is None, "the failed push's session is still open"
    assert info.desired.paused is paused, f"the fleet was {'not ' if not paused else ''}paused before the push"
    assert info.weight_version == committed
    assert fl.f.workers["w0"].state().paused is paused
    assert_holds(fl.f, "w0", trained(11))


async def on_event(nc, subjects: Subjects, kind: str, do) -> object:
    async def cb(msg) -> None:
        ev = event_decoder.decode(msg.data)
        if isinstance(ev, FleetEvent):
            do()

    sub = await nc.subscribe(subjects.event(kind), cb=cb)
    await nc.flush()
    return sub


async def test_a_push_whose_pause_fails_half_way_resumes_the_workers_it_paused(settled):
    fl, committed = settled
    fl.kill_process()  # still registered: the pause reaches w0 and finds nobody at wp
    with pytest.raises(rlbus.RLBusError):
        await fl.rl.push_weights(trained(12), new_version("lost-in-pause"), timeout=10)
    await assert_left_as_found(fl, committed)


async def test_a_push_whose_transfer_group_fails_resumes_the_fleet(settled):
    fl, committed = settled
    fl.rl.push.close()  # this push builds a new group
    sub = await on_event(fl.rl.nc, fl.rl.subjects, "paused", fl.kill_process)
    try:
        with pytest.raises(rlbus.RLBusError):
            await fl.rl.push_weights(trained(13), new_version("lost-in-init"), timeout=10)
    finally:
        await sub.unsubscribe()
    await assert_left_as_found(fl, committed)


async def test_a_push_whose_start_is_refused_resumes_the_fleet(settled):
    fl, committed = settled
    with pytest.raises(rlbus.FailedPrecondition, match="draft"):
        await fl.rl.push_weights(trained(14), new_version("no-draft"), draft=True)
    await assert_left_as_found(fl, committed)


async def test_a_push_whose_update_is_refused_aborts_and_resumes_the_fleet(settled):
    fl, committed = settled
    wrong = [(n, torch.zeros(t.numel() + 1, dtype=t.dtype)) for n, t in trained(15)]
    with pytest.raises(rlbus.InvalidArgument):
        await fl.rl.push_weights(wrong, new_version("wrong-shape"))
    await assert_left_as_found(fl, committed)


async def test_a_push_whose_finish_is_refused_aborts_and_resumes_the_fleet(settled):
    fl, committed = settled
    with pytest.raises(rlbus.InvalidArgument):
        await fl.rl.push_weights(trained(16), "not\nprintable")
    await assert_left_as_found(fl, committed)


async def test_a_failed_push_leaves_a_fleet_it_found_paused_paused(settled):
    fl, committed = settled
    await fl.rl.pause("keep")
    try:
        wrong = [(n, torch.zeros(t.numel() + 1, dtype=t.dtype)) for n, t in trained(17)]
        with pytest.raises(rlbus.InvalidArgument):
            await fl.rl.push_weights(wrong, new_version("wrong-shape"))
        await assert_left_as_found(fl, committed, paused=True)
    finally:
        await fl.rl.resume()


# ---- the deadline holds with the controller SIGKILLed mid-session -------------------------------


def _controller(url: str, prefix: str) -> subprocess.Popen:
    return spawn_controller(url, prefix, "--lease", "1", "--liveness-timeout", "1.5", "--command-timeout", "10")


@pytest.fixture
async def controller_process(nats_server) -> AsyncIterator[tuple[RLClient, subprocess.Popen, Subjects]]:
    prefix = "k" + os.urandom(5).hex()
    subjects = Subjects(prefix=prefix)
    f = LocalFleet(nats_server.url)
    proc = _controller(nats_server.url, prefix)
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=30.0)
    try:
        for wid in ("d0", "d1"):
            await f.start_worker(
                ReferenceEngine(MODEL),
                WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.2, weight_transfer_backend="gloo"),
            )

        async def both() -> bool:
            try:
                return len((await rl.server_info()).workers) == 2
            except rlbus.RLBusError:
                return False

        await eventually(both, timeout=60, what="the controller process serving both workers")
        yield rl, proc, subjects
    finally:
        if proc.poll() is None:
            proc.kill()
        await anyio.to_thread.run_sync(proc.wait, 10)
        await rl.close()
        await f.close()


async def test_timeout_bounds_a_push_whose_controller_is_sigkilled_mid_session(controller_process):
    rl, proc, subjects = controller_process
    await rl.push_weights(trained(21), new_version("before"))
    sub = await on_event(rl.nc, subjects, "session_started", proc.kill)
    timeout = 10.0
    t0 = time.monotonic()
    try:
        with pytest.raises(rlbus.RLBusError):
            await rl.push_weights(trained(22), new_version("orphaned"), timeout=timeout)
    finally:
        await sub.unsubscribe()
    took = time.monotonic() - t0
    print(f"\npush with a {timeout:g}s timeout, controller SIGKILLed mid-session, returned after {took:.2f}s")
    assert proc.poll() is not None, "the controller was killed mid-session"
    assert took <= timeout + PUSH_SLACK_S, f"push_weights ran {took - timeout:.1f}s past its {timeout:g}s timeout"
