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
import msgspec
import pytest
from rlbus.schemas import FleetState, KvKey, Nack, Pause, Subjects, encode, op_of, reply_decoder
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


def _counted(f: LocalFleet, monkeypatch, owner: str, method: str) -> dict[str, int]:
    """How many times each worker's `owner` (an attribute of its service) ran `method`."""
    counts = dict.fromkeys(WORKERS, 0)
    for wid in WORKERS:
        target = getattr(f.workers[wid], owner)
        original = getattr(target, method)

        async def counted(*a, _wid=wid, _original=original, **k):
            counts[_wid] += 1
            return await _original(*a, **k)

        monkeypatch.setattr(target, method, counted)
    return counts


async def test_a_finish_whose_claim_the_store_refuses_leaves_its_session_open_and_its_retry_commits(
    fleet, raw, monkeypatch
):
    f, rl, subjects = fleet
    assert f.controller is not None
    await rl.push.start("main")
    await rl.push.update(trained(11), None)
    sid = rl.push.session_id
    prepares = _counted(f, monkeypatch, "updates", "prepare")
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


async def _pause_sent_once_without_first_send_header(raw, subjects: Subjects) -> object:
    """A pause as a client that does not say a send is its id's first sends it (no header)."""
    msg = await raw.request(subjects.control(op_of(Pause)), encode(Pause(mode="keep", command_id=uuid.uuid4().hex)), 20)
    return reply_decoder.decode(msg.data)


async def test_a_pauses_first_send_runs_beside_its_claim_and_a_refused_claim_takes_the_fleet_back(
    fleet, raw, monkeypatch
):
    """The SDK's first send of a pause says so (no earlier run of its id can exist), so its claim
    lands beside the fan-out: with the claim refused the workers did pause, then went back to
    running; the refusal answers, and nothing says the fleet is paused (memory, KV, workers)."""
    f, rl, subjects = fleet
    assert f.controller is not None
    await rl.resume()
    pauses = _counted(f, monkeypatch, "engine", "pause")
    await capped_bucket(raw, subjects.replies_bucket, True)
    with anyio.fail_after(20), pytest.raises(rlbus.Unavailable) as err:
        await rl.pause("keep")
    assert "_replies" in err.value.message, err.value.message
    assert pauses == dict.fromkeys(WORKERS, 1), "the first send's fan-out did not run beside its claim"
    assert not any(w.state().paused for w in f.workers.values()), "a refused pause left workers paused"
    assert not f.controller.desired.paused
    kv = await raw.jetstream().key_value(subjects.kv_bucket)
    assert not msgspec.json.decode((await kv.get(KvKey.DESIRED)).value, type=FleetState).paused

    # a send that does not say it is the first is claimed before anything runs: refused, it ran nothing
    refused = await _pause_sent_once_without_first_send_header(raw, subjects)
    assert isinstance(refused, Nack) and refused.code == "UNAVAILABLE", refused
    assert pauses == dict.fromkeys(WORKERS, 1), "a send not said to be the first ran before its claim"

    await capped_bucket(raw, subjects.replies_bucket, False)
    await rl.pause("keep")
    assert all(w.state().paused for w in f.workers.values())


async def test_a_resumes_first_send_whose_claim_the_store_refuses_leaves_the_fleet_paused(fleet, raw):
    f, rl, subjects = fleet
    assert f.controller is not None
    await capped_bucket(raw, subjects.replies_bucket, True)
    with anyio.fail_after(20), pytest.raises(rlbus.Unavailable):
        await rl.resume()
    assert all(w.state().paused for w in f.workers.values()), "a refused resume left workers running"
    assert f.controller.desired.paused
    await capped_bucket(raw, subjects.replies_bucket, False)
    await rl.resume()
    assert not any(w.state().paused for w in f.workers.values())
