"""The decided commit: once every worker prepared, the decision is in the state store before any
worker commits, and from it on the outcome is commit. A worker that fails or misses its commit
is quarantined (withheld, named) until it holds exactly the decided bits; a seq names one set of
bits forever; a controller that takes over finishes a decided commit and publishes it once.

Worker processes are real (`rlbus worker` over gloo); w1's link runs through a TCP proxy whose
tripwire signals it (SIGKILL, SIGSTOP) the moment its commit command reaches it, before it can
read it. The controller is in-process here (its store is read directly), a real process in the
takeover test (it is SIGKILLed the moment its decision is in the store).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator

import anyio
import msgspec
import nats
import pytest
from rlbus.schemas import (
    CommitDecision,
    FleetAck,
    GenerateReply,
    GetServerInfo,
    KvKey,
    ServerInfo,
    Subjects,
    VersionInfo,
)
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.fleet import controller_process, worker_command
from tests.netfaults import Blackhole
from tests.waiting import eventually
from tests.weights_helpers import MAX_TOKENS, MODEL, PROMPTS, VersionEvents, assert_holds, greedy, new_version, trained

WORKERS = ["w0", "w1"]
COMMAND_TIMEOUT_S = 3.0
LIVENESS_S = 1.5


class ProcessFleet:
    """An in-process controller and worker processes; w1 talks to NATS through `hole`."""

    def __init__(self, url: str, prefix: str, hole: Blackhole) -> None:
        self.url, self.prefix, self.hole = url, prefix, hole
        self.local = LocalFleet(url)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, worker_id: str, url: str) -> None:
        self.procs[worker_id] = subprocess.Popen(
            worker_command(url, self.prefix, worker_id, "gloo"),
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def arm(self, worker_id: str, sig: int) -> None:
        """Send `sig` to the worker the moment its next commit command reaches its link."""
        proc = self.procs[worker_id]
        self.hole.tripwire = (
            f" {Subjects(self.prefix).worker(worker_id, 'commit')} ".encode(),
            lambda: proc.send_signal(sig),
        )

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            await anyio.to_thread.run_sync(proc.wait, 10)
        await self.local.close()


async def _registered(rl: RLClient, want: list[str]) -> bool:
    try:
        info = await rl.call(GetServerInfo(), ServerInfo, timeout=2.0)
    except rlbus.RLBusError:
        return False
    return sorted(w.worker_id for w in info.workers) == want


@pytest.fixture
async def procs(nats_server) -> AsyncIterator[tuple[ProcessFleet, RLClient]]:
    prefix = "c" + uuid.uuid4().hex[:8]
    async with Blackhole(nats_server.port) as hole:
        fleet = ProcessFleet(nats_server.url, prefix, hole)
        await fleet.local.start_controller(
            ControllerOptions(
                subjects=Subjects(prefix=prefix),
                lease_s=1.0,
                command_timeout_s=COMMAND_TIMEOUT_S,
                liveness_timeout_s=LIVENESS_S,
            )
        )
        rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=30.0)
        try:
            fleet.start("w0", nats_server.url)
            fleet.start("w1", hole.url)
            await eventually(lambda: _registered(rl, WORKERS), timeout=60, interval=0.1, what="both worker processes")
            yield fleet, rl
        finally:
            await rl.close()
            await fleet.stop()


async def _replies(rl: RLClient, want: set[str], rounds: int = 40) -> dict[str, list[GenerateReply]]:
    """Greedy generations of every prompt until each worker in `want` answered all of them."""
    seen: dict[str, dict[int, GenerateReply]] = {}

    async def covered() -> bool:
        for i, p in enumerate(PROMPTS):
            r = await rl.generate(p, MAX_TOKENS)
            seen.setdefault(r.worker_id, {})[i] = r
        return all(len(seen.get(w, {})) == len(PROMPTS) for w in want)

    await eventually(covered, timeout=30, interval=0, what=f"generations from {sorted(want)}")
    return {w: [seen[w][i] for i in range(len(PROMPTS))] for w in seen}


def _serves(replies: list[GenerateReply], named: list, version: str, seq: int) -> None:
    assert [r.tokens for r in replies] == greedy(named), "its tokens are not the committed weights'"
    assert {(r.weight_version, r.weight_seq) for r in replies} == {(version, seq)}


async def test_a_worker_killed_as_its_commit_reaches_it_is_quarantined_and_the_commit_stands(procs):
    fleet, rl = procs
    store = fleet.local.controller.store
    await rl.push_weights(trained(31), new_version("before"))
    seq = (await rl.server_info()).weight_seq

    fleet.arm("w1", signal.SIGKILL)  # every worker prepares; w1 dies as its commit arrives
    new, version = trained(32), new_version("decided")
    ack = await rl.push_weights(new, version)

    assert ack.quarantined == ["w1"], "the finish names the worker that missed its commit"
    assert [w.worker_id for w in ack.workers] == ["w0"]
    stored = await store.version()
    assert (stored.version, stored.seq) == (version, seq + 1), "the decided commit is the committed version"
    decision = await store.decision()
    assert decision is not None and decision.seq == seq + 1 and decision.published and decision.quarantined == ["w1"]
    assert len(decision.checksums) > 0, "the decision keeps the manifest a repair verifies against"
    _serves((await _replies(rl, {"w0"}))["w0"], new, version, seq + 1)

    fleet.start("w1", fleet.url)  # restarted: on its initial weights, it is withheld until w0 repaired it
    await eventually(lambda: _registered(rl, WORKERS), timeout=60, interval=0.1, what="w1 back")
    while (await rl.server_info()).quarantined:
        replies = await asyncio.gather(*(rl.generate(p, MAX_TOKENS) for p in PROMPTS))
        for r in replies:  # while quarantined, only the decided bits are served, by w0
            assert r.worker_id == "w0" or (r.weight_version, r.weight_seq) == (version, seq + 1), (
                "a quarantined worker served other bits"
            )
    info = await rl.server_info()
    w1 = next(w for w in info.workers if w.worker_id == "w1")
    assert not w1.quarantined and not w1.behind and not w1.state.withheld, "repaired: released from quarantine"
    for replies in (await _replies(rl, set(WORKERS))).values():
        _serves(replies, new, version, seq + 1)

    later, again = trained(33), new_version("after")
    ack = await rl.push_weights(later, again)  # the trainer's next push brings it the committed bits
    assert ack.quarantined == [] and sorted(w.worker_id for w in ack.workers) == WORKERS
    assert (await rl.server_info()).quarantined == []
    for replies in (await _replies(rl, set(WORKERS))).values():
        _serves(replies, later, again, seq + 2)


async def test_a_worker_frozen_as_its_commit_reaches_it_never_makes_one_seq_name_two_sets_of_bits(procs):
    fleet, rl = procs
    await rl.push_weights(trained(41), new_version("before"))
    seq = (await rl.server_info()).weight_seq

    fleet.arm("w1", signal.SIGSTOP)
    decided, version = trained(42), new_version("decided")
    ack = await rl.push_weights(decided, version)
    assert ack.quarantined == ["w1"]
    assert (await rl.server_info()).weight_seq == seq + 1

    fleet.procs["w1"].send_signal(signal.SIGCONT)  # it applies the commit it was sent: the decided bits, seq + 1
    await eventually(lambda: _released(rl), timeout=30, interval=0.1, what="w1 back and holding the decided commit")
    by_worker = await _replies(rl, set(WORKERS))
    for replies in by_worker.values():
        _serves(replies, decided, version, seq + 1)

    later, again = trained(43), new_version("next")
    await rl.push_weights(later, again)
    assert (await rl.server_info()).weight_seq == seq + 2, "the next commit reused a seq that names other bits"
    for replies in (await _replies(rl, set(WORKERS))).values():
        _serves(replies, later, again, seq + 2)


async def _released(rl: RLClient) -> bool:
    info = await rl.server_info()
    return (
        not info.quarantined
        and sorted(w.worker_id for w in info.workers) == WORKERS
        and not any(w.state.withheld for w in info.workers)
    )


# ---- a controller killed right after its decision -------------------------------------------


def _controller(url: str, prefix: str) -> subprocess.Popen:
    return controller_process(
        url, prefix, "--lease", "1", "--liveness-timeout", str(LIVENESS_S), "--command-timeout", str(COMMAND_TIMEOUT_S)
    )


@pytest.mark.parametrize("record", [KvKey.DECISION, KvKey.VERSION])
async def test_a_controller_killed_after_its_decision_is_succeeded_by_one_that_publishes_it_once(nats_server, record):
    """Killed the moment its decision is in the store, or the decided version (written after
    phase 2, ahead of the reply: rl.version has not said it yet, and the decision is not marked
    done until it has)."""
    prefix = "d" + uuid.uuid4().hex[:8]
    subjects = Subjects(prefix=prefix)
    local = LocalFleet(nats_server.url)
    controllers = [_controller(nats_server.url, prefix)]
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=30.0)
    nc = await nats.connect(nats_server.url)
    try:
        for wid in WORKERS:
            await local.start_worker(
                ReferenceEngine(MODEL),
                WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.2, weight_transfer_backend="shm"),
            )
        await eventually(lambda: _registered(rl, WORKERS), timeout=30, interval=0.1, what="the first controller")
        await rl.push_weights(trained(51), new_version("before"))
        seq = (await rl.server_info()).weight_seq
        kv = await nc.jetstream().key_value(subjects.kv_bucket)
        watch = await kv.watch(record, include_history=False)
        killed = asyncio.Event()
        kind = CommitDecision if record == KvKey.DECISION else VersionInfo

        async def kill_on_decision() -> None:
            async for entry in watch:
                if entry is not None and entry.value and msgspec.json.decode(entry.value, type=kind).seq > seq:
                    controllers[0].send_signal(signal.SIGKILL)  # decided: its commit not recorded done, none published
                    killed.set()
                    return

        named, version = trained(52), new_version("decided")
        async with VersionEvents(rl) as events, anyio.create_task_group() as tg:
            tg.start_soon(kill_on_decision)
            await rl.start_weight_update()
            await rl.update_weights(named)
            finish = asyncio.ensure_future(rl.finish_weight_update(version))
            await asyncio.wait_for(killed.wait(), 30)
            controllers.append(_controller(nats_server.url, prefix))  # the successor finds the decision
            # resent to the successor (same id): not run twice, answered from the commit it finished
            ack = await finish
            assert isinstance(ack, FleetAck) and ack.weight_version == version, ack

            async def committed_everywhere() -> bool:
                info = await rl.server_info()
                return (
                    (info.weight_version, info.weight_seq) == (version, seq + 1)
                    and not info.quarantined
                    and all(
                        (w.state.weight_version, w.state.weight_seq, w.state.withheld) == (version, seq + 1, False)
                        for w in info.workers
                    )
                    and len(info.workers) == len(WORKERS)
                )

            await eventually(committed_everywhere, timeout=30, interval=0.1, what="the successor finishing the commit")
            await events.wait_for(1)
            await rl.push_weights(trained(53), new_version("next"))
            await events.wait_for(2)
            assert [(v.version, v.seq) for v in events.seen][:1] == [(version, seq + 1)]
            assert [v.seq for v in events.seen] == [seq + 1, seq + 2], (
                "the decided version was not published exactly once"
            )
        for wid in WORKERS:
            assert_holds(local, wid, trained(53))
    finally:
        await rl.close()
        await nc.close()
        for proc in controllers:
            if proc.poll() is None:
                proc.kill()
            await anyio.to_thread.run_sync(proc.wait, 10)
        await local.close()
