"""A worker is brought to the fleet's desired state whenever it (re)joins. One real worker
process is frozen (SIGSTOP) past the liveness timeout at each step and continued (SIGCONT):
pause -> drop -> rejoin -> sleep -> drop -> rejoin -> push while it is away -> rejoin (and a
repair from its peer). After each rejoin it holds the desired state before it is counted, and no
generation reply comes from it while it is in the wrong state."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator

import pytest
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.runners.children import spawn
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.fleet import worker_command
from tests.looplag import LoopLag
from tests.waiting import eventually
from tests.weights_helpers import MODEL, new_version, trained

LIVENESS_S = 1.0
PROC = "wp"


def _worker_cmd(url: str, prefix: str) -> list[str]:
    return worker_command(url, prefix, PROC, "gloo", MODEL)


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix) -> AsyncIterator[tuple[LocalFleet, RLClient, subprocess.Popen]]:
    subjects = Subjects(prefix=prefix)
    f = LocalFleet(nats_server.url)
    await f.start_controller(ControllerOptions(subjects=subjects, command_timeout_s=5.0, liveness_timeout_s=LIVENESS_S))
    await f.start_worker(
        ReferenceEngine(MODEL),
        WorkerOptions(worker_id="w0", subjects=subjects, heartbeat_s=0.2, weight_transfer_backend="gloo"),
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = spawn(_worker_cmd(nats_server.url, prefix), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=20.0)
    try:
        await eventually(lambda: PROC in f.controller.registry, timeout=60, what="the worker process registered")
        yield f, rl, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(20)
        await rl.close()
        await f.close()


async def _drop_and_rejoin(f: LocalFleet, proc: subprocess.Popen, while_away=None) -> None:
    """Freeze the worker until the controller drops it, run `while_away`, continue it and
    wait until it is registered again."""
    proc.send_signal(signal.SIGSTOP)
    try:
        await eventually(lambda: PROC not in f.controller.registry, timeout=10, what="the frozen worker dropped")
        if while_away is not None:
            await while_away()
    finally:
        proc.send_signal(signal.SIGCONT)
    await eventually(lambda: PROC in f.controller.registry, timeout=15, what="the worker rejoined")


def _state(f: LocalFleet):
    return f.controller.registry.state(PROC)


async def test_a_worker_rejoining_a_paused_fleet_is_paused_before_it_counts(fleet):
    f, rl, proc = fleet

    async def pause() -> None:
        ack = await rl.pause("wait")  # acked by the others only: the frozen worker is not registered
        assert PROC not in [w.worker_id for w in ack.workers]

    async with LoopLag(bound=0.5):
        await _drop_and_rejoin(f, proc, pause)
        assert _state(f).paused and _state(f).pause_mode == "wait"
        assert await rl.is_paused()
        info = await rl.server_info()
        assert info.desired.paused and all(w.state.paused for w in info.workers)
        await rl.resume()
        assert not _state(f).paused


async def test_a_worker_rejoining_a_sleeping_fleet_falls_asleep(fleet):
    f, rl, proc = fleet

    async def sleep() -> None:
        await rl.pause("abort")
        await rl.sleep(level=1)
        await rl.resume()

    async with LoopLag(bound=0.5):
        await _drop_and_rejoin(f, proc, sleep)
        assert sorted(_state(f).sleeping_tags) == ["kv_cache", "weights"]
        assert await rl.is_sleeping()
        await rl.wake_up()
        assert not _state(f).sleeping_tags and not await rl.is_sleeping()


async def test_a_worker_that_missed_a_push_serves_nothing_until_a_peer_repaired_it(fleet):
    f, rl, proc = fleet
    version = new_version("while-away")
    named = trained(41)

    async def push() -> None:
        await rl.push_weights(named, version, delta=True)  # tracked: the next delta push is against it

    async with LoopLag(bound=0.5):
        await _drop_and_rejoin(f, proc, push)
        # until it holds the committed weights, every reply comes from a worker on them: the
        # rejoined worker serves again only once repaired, and the controller's view of that
        # (its registry) may lag the worker's own gate by a heartbeat
        while _state(f).withheld:
            reply = await rl.generate([1, 2, 3], 2)
            assert reply.weight_version == version, (
                f"worker {reply.worker_id} served on {reply.weight_version}, behind the committed {version}"
            )
            if reply.worker_id == PROC:
                await eventually(lambda: not _state(f).withheld, timeout=5, what="the registry saw the repair")
        # repaired from w0 without a push: exactly the committed bits, version and seq
        st = _state(f)
        assert (st.weight_version, st.weight_seq) == (version, f.controller.version.seq)
        assert (await rl.verify_weights(named)).ok
        seen = set()
        for _ in range(20):
            reply = await rl.generate([1, 2, 3], 2)
            assert reply.weight_version == version
            seen.add(reply.worker_id)
            if seen == {"w0", PROC}:
                break
        assert seen == {"w0", PROC}, "the repaired worker takes generation traffic again"
        again = new_version("together")
        await rl.push_weights(trained(42), again, delta=True)
        last = rl.last_push
        assert last is not None and last.delta and last.fallback is None, f"not a delta for the whole fleet: {last}"
