"""Failover loses no call: real controller processes (a leader and a standby) in front of an
in-process fleet. The leader's link is blackholed, then the next leader is frozen (SIGSTOP), then
the next is killed (SIGKILL); trainer calls made right after each fault all succeed, on the next
leader, within their deadline.

The server keeps nats-server's default pings (every 2 minutes, as compose.yaml's image and a
user's own cluster run): a blackholed or frozen leader's subscriptions linger for minutes, so
failover must not wait for the server to drop them. The standby takes over when the lease lapses
and serves the control subjects in a queue group of its own, so every call reaches it; the SDK
resends a command (same id) that got no answer within attempt_s, or retries while nothing
answers. The gap is printed, not asserted."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import anyio
import pytest
from rlbus.schemas import Subjects
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.runners.local import LocalFleet
from rlbus.runners.natsserver import NatsServer
from rlbus.sdk.client import RLClient
from tests.fleet import controller_process
from tests.looplag import LoopLag
from tests.netfaults import Blackhole
from tests.waiting import eventually
from tests.weights_helpers import MODEL

LEASE_S = 1.0
CALLS = 6
CALL_TIMEOUT_S = 6.0


def _controller(url: str, prefix: str) -> subprocess.Popen:
    return controller_process(
        url, prefix, "--lease", str(LEASE_S), "--liveness-timeout", "1.5", "--command-timeout", "5"
    )


async def _leader(rl: RLClient) -> str:
    return (await rl.server_info()).controller_id


async def _calls_after_a_fault(rl: RLClient, old: str) -> tuple[float, list[str]]:
    """CALLS pause/resume pairs right after a fault; every one must succeed. Returns the time
    to the first answer and who answered each."""
    t0 = time.monotonic()
    first: float | None = None
    answered = []
    for _ in range(CALLS):
        paused = await rl.pause("abort")
        first = first if first is not None else time.monotonic() - t0
        assert all(w.paused for w in paused.workers) and len(paused.workers) == 2
        await rl.resume()
        answered.append(await _leader(rl))
    assert not await rl.is_paused(), "a resume was lost in the failover"
    assert old not in answered
    return first or 0.0, answered


@pytest.fixture(scope="module")
def default_pings_server() -> Iterator[NatsServer]:
    """A server with nats-server's own ping settings: it notices a silent client in minutes."""
    with NatsServer(liveness=False) as server:
        yield server


@pytest.fixture
async def fleet(default_pings_server, prefix):
    nats_server = default_pings_server
    subjects = Subjects(prefix=prefix)
    f = LocalFleet(nats_server.url)
    hole = Blackhole(nats_server.port)
    await hole.__aenter__()
    procs = [_controller(hole.url, prefix)]  # the first leader's link goes through the proxy
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=30.0)
    try:
        for wid in ("w0", "w1"):
            await f.start_worker(
                ReferenceEngine(MODEL), WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.2)
            )
        await eventually(lambda: _two_workers(rl), timeout=30, what="the first controller serving both workers")
        yield f, rl, procs, nats_server.url, prefix, hole
    finally:
        await hole.__aexit__(None, None, None)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                await anyio.to_thread.run_sync(p.wait, 10)
        await rl.close()
        await f.close()


async def _two_workers(rl: RLClient) -> bool:
    try:
        return len((await rl.server_info()).workers) == 2
    except Exception:
        return False


async def _standby_ready(rl: RLClient, proc: subprocess.Popen) -> None:
    # the standby process is up once it has had time to import and find the lease held; it does
    # not answer rl.control.* (only the leader serves them), so wait on the process itself
    await eventually(lambda: proc.poll() is None and _age(proc) > 2.0, timeout=10, what="the standby started")


def _age(proc: subprocess.Popen) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
    uptime = float(open("/proc/uptime").read().split()[0])
    return uptime - start


async def test_no_call_is_lost_when_the_leader_freezes_or_dies(fleet):
    f, rl, procs, url, prefix, hole = fleet
    faults = [
        ("blackholed", lambda: setattr(hole, "holed", True)),  # the link goes silent: no error, no close
        ("frozen (SIGSTOP)", lambda: procs[1].send_signal(signal.SIGSTOP)),
        ("killed (SIGKILL)", lambda: procs[2].send_signal(signal.SIGKILL)),
    ]
    rl.timeout = CALL_TIMEOUT_S  # the SDK resends within it (a third of it), so a lost attempt is not a lost call
    async with LoopLag(bound=0.5):
        leader = await _leader(rl)
        for what, fault in faults:  # each hits the leader of the moment: procs[0], then [1], then [2]
            procs.append(_controller(url, prefix))
            await _standby_ready(rl, procs[-1])
            fault()
            gap, answered = await _calls_after_a_fault(rl, leader)
            print(f"\nleader {what}: first call answered after {gap:.2f}s by {answered[0]}")
            leader = answered[-1]
    procs[1].send_signal(signal.SIGCONT)  # the frozen leader finds its lease taken and steps down
    await anyio.to_thread.run_sync(procs[1].wait, 15)
