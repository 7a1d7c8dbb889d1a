"""Soak: a seeded run of pushes with faults mixed in — a worker killed mid-session (and a
replacement started), a worker too slow to prepare, a corrupted bucket, a worker process frozen
(SIGSTOP) past the liveness timeout while a push commits without it, the controller killed
between pushes or in the middle of one (and a new one started), clean pushes.

After every iteration the fleet must be in step: every registered worker holds the committed
weights and version (a worker that missed a commit is `behind` and withheld until a healthy peer
repairs it, or, when no worker holds the committed bits, until a push brings it current), no generation reply comes from weights other than the committed ones, and the
committed versions, as published, are exactly the successful pushes in order (no gap, no
repeat, no regression). Every failure is a typed rlbus error.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from rlbus.schemas import CommitWorker, Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.runners.children import spawn
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.fleet import worker_command
from tests.waiting import eventually
from tests.weights_helpers import (
    MODEL,
    VersionEvents,
    assert_holds,
    greedy,
    send_corrupted,
    trained,
)

SEED = 20240607
COMMAND_TIMEOUT_S = 2.0
LIVENESS_S = 1.0
# how many of each iteration kind the run holds, in an order the seeded RNG shuffles
SCHEDULE = {"kill": 4, "slow": 4, "corrupt": 5, "freeze": 3, "controller": 4, "clean": 10}
# where a "controller" iteration kills it: between pushes, or in a push whose session is open
# (before any byte moved; with every byte sent and finish not yet asked; in finish, once every
# worker committed and before the controller recorded the version)
CONTROLLER_KILLS = ("between", "opened", "sent", "committed")
BUDGET_S = 60.0
PROC = "sp"
"""The one worker that runs as a real process (so it can be frozen)."""
GEN_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]] * 2
GEN_TOKENS = 6


def _options(prefix: str) -> ControllerOptions:
    return ControllerOptions(
        subjects=Subjects(prefix=prefix),
        command_timeout_s=COMMAND_TIMEOUT_S,
        liveness_timeout_s=LIVENESS_S,
        lease_s=1.0,
    )


def _worker_cmd(url: str, prefix: str) -> list[str]:
    return worker_command(url, prefix, PROC, "shm", MODEL)


async def _worker(f: LocalFleet, prefix: str, worker_id: str) -> None:
    await f.start_worker(
        ReferenceEngine(MODEL),
        WorkerOptions(
            worker_id=worker_id, subjects=Subjects(prefix=prefix), heartbeat_s=0.2, weight_transfer_backend="shm"
        ),
    )
    await f.wait_for_workers([worker_id])


async def _group_ready(rl: RLClient) -> None:
    """A transfer group of exactly the registered workers (short collective timeout)."""
    info = await rl.server_info()
    members = sorted(w.worker_id for w in info.workers)
    if (
        not rl.transfer_ready
        or members != sorted(rl.push.group)
        or not all(w.state.transfer_ready for w in info.workers)
    ):
        await rl.init_weight_transfer(timeout_s=5)


def _builds(build, kind: type, workers: list[str]) -> bool:
    """Whether a controller fan-out builder makes `kind` commands."""
    try:
        return bool(workers) and isinstance(build(workers[0], 0, ""), kind)
    except Exception:  # a builder for other workers only
        return False


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


@pytest.fixture(scope="module")
async def fleet(
    nats_server, prefix, tmp_path_factory
) -> AsyncIterator[tuple[LocalFleet, RLClient, subprocess.Popen, Path]]:
    log = tmp_path_factory.mktemp("soak") / f"{PROC}.log"
    with log.open("wb") as out:  # the process boots (imports torch) while the in-process fleet starts
        proc = spawn(
            _worker_cmd(nats_server.url, prefix),
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    f = LocalFleet(nats_server.url)
    rl = None
    try:
        await f.start_controller(_options(prefix))
        for wid in ("s0", "s1", "s2"):
            await _worker(f, prefix, wid)
        await eventually(
            lambda: f.controller is not None and PROC in f.controller.registry,
            timeout=60,
            what=f"the worker process registered; its log:\n{_tail(log)}",
        )
        rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=20.0)
        await rl.init_weight_transfer(timeout_s=5)
        yield f, rl, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        print(f"\n--- {PROC} log (tail) ---\n{_tail(log)}")
        if rl is not None:
            await rl.close()
        await f.close()


async def test_a_seeded_run_of_pushes_and_faults_keeps_the_fleet_in_step(fleet, prefix, monkeypatch):
    f, rl, proc, log = fleet
    assert f.controller is not None
    rng = random.Random(SEED)
    plan = [kind for kind, n in SCHEDULE.items() for _ in range(n)]
    rng.shuffle(plan)
    done: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    kills: Counter[str] = Counter()
    committed: list[str] = []
    holds = trained(MODEL.seed)  # what every current worker holds now
    expected_tokens: dict[str, list[list[int]]] = {}
    behind: set[str] = set()  # registered workers that missed the last commit (withheld)
    served_by: Counter[str] = Counter()
    started = time.monotonic()

    async def push(seed: int) -> None:
        nonlocal holds
        named, version = trained(seed), f"soak-{len(committed) + 1}"
        await rl.push_weights(named, version)
        committed.append(version)
        holds = named
        behind.clear()  # a commit reaches every registered worker, the withheld ones too

    def registered() -> list[str]:
        return sorted([*f.workers, PROC])

    async def restart_controller() -> None:
        """A new controller with the same options; every worker (the process too) rejoins it."""
        await f.start_controller(_options(prefix))
        await f.wait_for_workers(registered())

    async def in_step(i: int, kind: str) -> None:
        want = committed[-1] if committed else "default"
        where = f"after iteration {i} ({kind})"
        if behind and set(behind) != set(registered()):
            # a healthy peer holds the committed weights: it repairs the others, without a push
            async def repaired() -> bool:
                return not any(w.behind or w.state.withheld for w in (await rl.server_info()).workers)

            await eventually(repaired, timeout=30, what=f"{sorted(behind)} repaired {where}")
            behind.clear()
        info = await rl.server_info()
        assert info.weight_version == want and info.session_id is None, where
        assert not info.desired.paused, f"the fleet is left paused {where}"
        assert sorted(w.worker_id for w in info.workers) == registered(), where
        assert sorted(w.worker_id for w in info.workers if w.behind) == sorted(behind), where
        for w in info.workers:
            if w.worker_id in behind:
                assert w.state.weight_version != want and w.state.withheld, f"{w.worker_id} {where}"
            else:
                assert (w.state.weight_version, w.state.weight_seq) == (want, info.weight_seq), f"{w.worker_id} {where}"
                assert not w.state.withheld and w.state.session_id is None and not w.state.paused, (
                    f"{w.worker_id} {where}"
                )
        everyone_behind = bool(behind) and set(behind) == set(registered())
        try:
            vi = await rl.get_weight_version_info()
        except rlbus.FailedPrecondition as refused:  # workers lag (some, or all): a typed refusal naming them
            assert behind, f"get_weight_version_info() refused: {refused.message} {where}"
            assert all(b in refused.message for b in behind), where
        else:
            assert (vi.version, vi.seq) == (want, info.weight_seq), (
                f"get_weight_version_info() reported {vi.version!r} (seq {vi.seq}) while the committed version is "
                f"{want!r} (seq {info.weight_seq}) and {sorted(behind) or 'no worker'} lag {where}"
            )
        current = (want, info.weight_seq)
        for wid, w in f.workers.items():
            assert w.updates.session_id is None, f"{wid} {where}"
            if wid in behind:
                assert w.book.main.version != want, f"{wid} {where}"
            else:
                assert w.book.main.version == want, f"{wid} {where}"
                assert_holds(f, wid, holds)
        # no reply from weights other than the committed ones: version, sequence and tokens
        if everyone_behind:  # nobody may serve: the request finds no responders (short deadline)
            for outcome in await asyncio.gather(
                *(rl.generate(p, GEN_TOKENS, timeout=1.0) for p in GEN_PROMPTS[:2]), return_exceptions=True
            ):
                assert isinstance(outcome, rlbus.Unavailable), f"{outcome!r} while every worker is behind {where}"
            return
        if want not in expected_tokens:
            expected_tokens[want] = greedy(holds, GEN_PROMPTS, GEN_TOKENS)
        replies = await asyncio.gather(*(rl.generate(p, GEN_TOKENS) for p in GEN_PROMPTS))
        for p, r, tokens in zip(GEN_PROMPTS, replies, expected_tokens[want], strict=True):
            served_by[r.worker_id] += 1
            assert (r.weight_version, r.weight_seq) == current, f"{r.worker_id} served {r.weight_version} {where}"
            assert r.worker_id not in behind, f"{r.worker_id} served while behind {where}"
            assert r.tokens == tokens, f"{r.worker_id} served other weights for {p} {where}"

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

                async def late_prepare(session_id: str, timeout: float, checksums, prepare=prepare) -> None:
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
                await eventually(
                    lambda gone=victim_id: gone not in f.controller.registry,
                    timeout=LIVENESS_S + 3,
                    what=f"{victim_id} dropped",
                )
                await _worker(f, prefix, f"r{i}")  # a replacement on the fresh model: stale until the next push
                assert (await rl.server_info()).session_id is None
                await push(seed + 500)  # must rebuild the group for the new membership
            elif kind == "freeze":
                proc.send_signal(signal.SIGSTOP)
                try:
                    await eventually(
                        lambda: PROC not in f.controller.registry,
                        timeout=LIVENESS_S + 5,
                        what=f"the frozen {PROC} dropped",
                    )
                    await push(seed)  # commits on the others; the group is rebuilt without it
                finally:
                    proc.send_signal(signal.SIGCONT)
                await eventually(
                    lambda: PROC in f.controller.registry, timeout=15, what=f"{PROC} rejoined; its log:\n{_tail(log)}"
                )
                behind.add(PROC)  # it missed that commit: withheld until the next one
            elif kind == "controller":
                when = CONTROLLER_KILLS[done[kind] % len(CONTROLLER_KILLS)]  # every kill point, in turn
                kills[when] += 1
                if when == "between":
                    await f.kill(f.controller)  # abrupt: no goodbye, the lease is left to lapse
                    await restart_controller()
                elif when == "committed":
                    old = f.controller
                    send = old.fleet.send
                    phase2 = anyio.Event()

                    async def crash_after_commit(build, workers=None, timeout=None, send=send, old=old, phase2=phase2):
                        out = await send(build, workers, timeout)
                        if _builds(build, CommitWorker, workers or old.registry.ids()):
                            await old.nc.close()  # dies here: nothing it does after phase 2 reaches anyone
                            phase2.set()
                        return out

                    monkeypatch.setattr(old.fleet, "send", crash_after_commit)
                    pushing = asyncio.create_task(rl.push_weights(trained(seed), f"never-{i}"))
                    try:
                        with anyio.fail_after(20):
                            await phase2.wait()
                            await f.kill(old)
                        await restart_controller()
                        with anyio.fail_after(30):
                            ack = await pushing
                    finally:
                        if not pushing.done():
                            pushing.cancel()
                    # the decision was durable before any worker committed: the successor records and
                    # publishes it, and the trainer's retried finish (never run twice) is answered with it
                    assert ack.weight_version == f"never-{i}", ack
                    committed.append(f"never-{i}")
                    holds = trained(seed)
                else:
                    # hold the trainer just before the step that follows the kill, so the kill
                    # lands in an open session every time (not after a fast push already ended)
                    step = "update" if when == "opened" else "finish"
                    real = getattr(rl.push, step)
                    reached, go = anyio.Event(), anyio.Event()

                    async def held(*args, real=real, reached=reached, go=go, **kw):
                        reached.set()
                        await go.wait()
                        return await real(*args, **kw)

                    monkeypatch.setattr(rl.push, step, held)
                    pushing = asyncio.create_task(rl.push_weights(trained(seed), f"never-{i}"))
                    try:
                        await eventually(
                            lambda reached=reached: f.controller.updates.session_id is not None and reached.is_set(),
                            what="a push with its session open",
                        )
                        await f.kill(f.controller)
                        go.set()  # the held call finds no controller: the SDK retries it through the handover
                        await restart_controller()
                        with pytest.raises(rlbus.RLBusError) as err:
                            with anyio.fail_after(30):
                                await pushing
                    finally:
                        go.set()
                        monkeypatch.setattr(rl.push, step, real)
                        if not pushing.done():
                            pushing.cancel()
                    failures[type(err.value).__name__] += 1
                await in_step(i, f"{kind} killed {when}, before the next push")
                await push(seed + 500)  # the same trainer, the same fleet: the next push works
            done[kind] += 1
            await in_step(i, kind)
        closing = bool(behind)
        if closing:  # the run ended on a worker behind: a last push brings the whole fleet current
            await push(1000 + len(plan))
            await in_step(len(plan), "closing push")

        # as published: exactly the successful pushes, in order
        assert await events.wait_for(len(committed)) == committed
        assert len(events.seen) == len(committed)

    info = await rl.server_info()
    assert [w.state.weight_version for w in info.workers] == [committed[-1]] * len(registered())
    took = time.monotonic() - started
    print(
        f"\nsoak (seed {SEED}): {dict(done)} iterations, {len(committed)} commits, failures raised {dict(failures)}, "
        f"controller kills {dict(kills)}, replies by worker {dict(served_by)}, {took:.1f}s"
    )
    assert done == Counter(SCHEDULE), "every scheduled fault ran"
    assert len(committed) == (
        SCHEDULE["clean"]
        + SCHEDULE["kill"]
        + SCHEDULE["freeze"]
        + SCHEDULE["controller"]
        + kills["committed"]
        + closing
    )
    assert sum(failures.values()) == (
        SCHEDULE["corrupt"]
        + SCHEDULE["slow"]
        + SCHEDULE["kill"]
        + SCHEDULE["controller"]
        - kills["between"]
        - kills["committed"]
    )
    assert set(kills) == set(CONTROLLER_KILLS), "the controller was killed at every point"
    assert PROC in served_by, f"{PROC} never served generation"
    assert took < BUDGET_S
