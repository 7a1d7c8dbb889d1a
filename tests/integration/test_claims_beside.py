"""A start's and a finish's claim in the answer store (what makes a retried command run once) is
sent as the command starts and lands beside its first fan-out, not before it: a session waits for
one fsync'd write in series (the decision) instead of three. What keeps a refusal changing nothing:
the start's fan-out only opens a session, which a refused claim aborts, and the finish's prepare
only checks, so a refused claim leaves the session open, as before the finish, for its retry. A
fan-out that finds workers gone says so only once the claim landed.

A real nats-server refuses the claims: the answer bucket's stream is capped at the bytes it holds
(KV streams discard new messages at their limit), then uncapped."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.integration.test_state_store_order import capped_bucket
from tests.weights_helpers import MODEL, VersionEvents, trained

WORKERS = ("w0", "w1")


@asynccontextmanager
async def running(
    url: str, raw, prefix: str, **options: object
) -> AsyncIterator[tuple[LocalFleet, RLClient, Subjects]]:
    """A controller (`options`) and two workers on a store of their own (nothing left by another
    test), a trainer that paused them and built the transfer group."""
    subjects = Subjects(prefix=f"{prefix}-{uuid.uuid4().hex[:6]}")
    opts = ControllerOptions(subjects=subjects, command_timeout_s=10, **options)  # type: ignore[arg-type]
    f = LocalFleet(url)
    rl = None
    try:
        await f.start_controller(opts)
        for wid in WORKERS:
            await f.start_worker(
                ReferenceEngine(MODEL),
                WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.25, weight_transfer_backend="gloo"),
            )
        await f.wait_for_workers(list(WORKERS))
        rl = await RLClient.connect(url, prefix=subjects.prefix, timeout=30.0)
        await rl.pause()
        await rl.init_weight_transfer()
        yield f, rl, subjects
    finally:
        await capped_bucket(raw, subjects.replies_bucket, False)
        if rl is not None:
            await rl.close()
        await f.close()


@pytest.fixture
async def fleet(nats_server, prefix, raw) -> AsyncIterator[tuple[LocalFleet, RLClient, Subjects]]:
    async with running(nats_server.url, raw, prefix, state_patience_s=1.0) as fleet:
        yield fleet


def _prepares(f: LocalFleet, monkeypatch) -> dict[str, int]:
    """How many prepares each worker ran."""
    counts = dict.fromkeys(WORKERS, 0)
    for wid in WORKERS:
        updates = f.workers[wid].updates
        prepare = updates.prepare

        async def counted(*a, _wid=wid, _prepare=prepare, **k):
            counts[_wid] += 1
            return await _prepare(*a, **k)

        monkeypatch.setattr(updates, "prepare", counted)
    return counts


async def test_a_finish_whose_claim_the_store_refuses_leaves_its_session_open_and_its_retry_commits(
    fleet, raw, monkeypatch
):
    f, rl, subjects = fleet
    assert f.controller is not None
    await rl.push.start("main")
    await rl.push.update(trained(11), None)
    sid = rl.push.session_id
    prepares = _prepares(f, monkeypatch)
    async with VersionEvents(rl) as events:
        await capped_bucket(raw, subjects.replies_bucket, True)
        with anyio.fail_after(20), pytest.raises(rlbus.Unavailable) as err:
            await rl.push.finish("v-refused")
        assert err.value.code == "UNAVAILABLE" and "_replies" in err.value.message, err.value.message
        # phase 1 ran beside the claim (it only checks); nothing was decided, committed or said
        assert prepares == dict.fromkeys(WORKERS, 1)
        assert f.controller.updates.session_id == sid, "the refused finish closed its session"
        for wid, w in f.workers.items():
            assert w.state().session_id == sid and w.state().weight_version == "default", wid
        assert events.seen == []

        await capped_bucket(raw, subjects.replies_bucket, False)
        done = await rl.push.finish("v-after")  # the same session, prepared again
        assert done.weight_version == "v-after"
        assert prepares == dict.fromkeys(WORKERS, 2)
        assert await events.wait_for(1) == ["v-after"]
    assert all(w.state().weight_version == "v-after" and w.state().session_id is None for w in f.workers.values())


async def test_a_start_whose_claim_the_store_refuses_leaves_no_session_open_and_its_retry_opens_one(fleet, raw):
    f, rl, subjects = fleet
    assert f.controller is not None
    await capped_bucket(raw, subjects.replies_bucket, True)
    with anyio.fail_after(20), pytest.raises(rlbus.Unavailable):
        await rl.push.start("main")
    assert f.controller.updates.session_id is None, "the refused start left a session open"
    assert all(w.state().session_id is None for w in f.workers.values()), "a worker kept the refused start's session"

    await capped_bucket(raw, subjects.replies_bucket, False)
    opened = await rl.push.start("main")
    assert opened.session_id is not None and f.controller.updates.session_id == opened.session_id
    await rl.push.update(trained(12), None)
    assert (await rl.push.finish("v-started-again")).weight_version == "v-started-again"


async def test_a_finish_whose_controller_died_before_its_claim_landed_is_answered_aborted_by_the_successor(
    nats_server, prefix, raw, monkeypatch
):
    """Nothing was decided, so the successor aborts the session it finds open; the trainer's resend
    (the same id) hears that, ABORTED naming the takeover, not that no session is open."""
    options = dict(state_patience_s=5.0, lease_s=1.0)
    async with running(nats_server.url, raw, prefix, **options) as (f, rl, subjects):
        rl.attempt_s = 1.0  # resend soon: the successor answers it
        await rl.push.start("main")
        await rl.push.update(trained(13), None)
        sid = rl.push.session_id
        in_prepare, release = anyio.Event(), anyio.Event()
        updates = f.workers["w0"].updates
        prepare = updates.prepare

        async def held(*a, **k):
            in_prepare.set()
            await release.wait()
            return await prepare(*a, **k)

        monkeypatch.setattr(updates, "prepare", held)
        await capped_bucket(raw, subjects.replies_bucket, True)  # the finish's claim cannot land
        answered: list[BaseException] = []

        async def finish() -> None:
            try:
                await rl.push.finish("v-never")
            except rlbus.RLBusError as e:
                answered.append(e)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(finish)
                await in_prepare.wait()
                assert f.controller is not None
                await f.kill(f.controller)  # in phase 1, its claim not landed
                release.set()
                await capped_bucket(raw, subjects.replies_bucket, False)
                await f.start_controller(ControllerOptions(subjects=subjects, command_timeout_s=10, **options))  # type: ignore[arg-type]
        assert len(answered) == 1 and isinstance(answered[0], rlbus.Aborted), answered
        assert sid is not None and sid in answered[0].message and "took over" in answered[0].message
        info = await rl.server_info()
        assert info.session_id is None and info.weight_version == "default"
