"""A write the controller sent ahead of a reply and whose first attempt the store refused is
sent again after the reply (StateStore.put_ahead). By then the next command may have written the
same key: the session's record (the next start), the push lease (the next trainer), the decision
(the next finish). Sent again after it, the old value would undo the new one (a successor would
find the open session closed, the lease free, or the newest decision replaced by the last one).
A write superseded by a newer one to its key is not sent again.

A commit answered before its record (the version's write, its rl.version event, its decision
marked done) was kept, whose record the store then refused for a whole patience, is recorded again
by the controller once the store takes writes: subscribers hear of it without waiting for the
next commit.

A real nats-server refuses the writes: the bucket's stream is capped at the bytes it holds
(KV streams discard new messages at their limit), then uncapped."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.controller.store import StateStore
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.bus.connection import connect, drain
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.waiting import eventually
from tests.weights_helpers import MODEL, VersionEvents, first_watched_version, trained


@pytest.fixture
async def store(nats_server, prefix) -> AsyncIterator[StateStore]:
    nc = await connect(nats_server.url, name="rlbus-test-store")
    try:
        yield await StateStore.open(nc, f"{prefix}_order", replicas=1, patience_s=1.0)
    finally:
        await drain(nc)


async def capped(store: StateStore, cap: bool) -> None:
    """Make the bucket's stream refuse every new write (at its limit), or take the cap off."""
    await capped_bucket(store.nc, store.config.bucket, cap)


async def capped_bucket(nc, bucket: str, cap: bool) -> None:
    js = nc.jetstream()
    stream = f"KV_{bucket}"
    info = await js.stream_info(stream)
    config = info.config
    config.max_bytes = info.state.bytes if cap else -1
    await js.update_stream(config)


async def test_a_write_refused_ahead_of_a_reply_is_not_sent_again_over_a_newer_one(store):
    await store.put("session", b"s1")
    await capped(store, True)
    old = await store.put_ahead("session", b"closed")  # the reply goes out; its store refused this
    await capped(store, False)
    await store.put("session", b"s2")  # the next command's write to the same key
    await old()  # after the reply: the refused write's retry
    value, _ = await store.get("session")
    assert value == b"s2", f"a superseded write was sent again over the newer one: {value!r}"


async def test_a_write_refused_ahead_of_a_reply_is_sent_again(store):
    await capped(store, True)
    old = await store.put_ahead("decision", b"d1")
    await capped(store, False)
    assert await old() > 0
    value, _ = await store.get("decision")
    assert value == b"d1"
    assert await old() > 0, "awaited again (a record run again after a failure), it writes again"


async def test_a_commit_whose_record_the_store_refused_for_its_patience_is_said_once_the_store_takes_writes(
    nats_server, prefix, raw, caplog, monkeypatch
):
    subjects = Subjects(prefix=f"{prefix}-rec")
    f = LocalFleet(nats_server.url)
    rl = None
    try:
        await f.start_controller(ControllerOptions(subjects=subjects, command_timeout_s=10, state_patience_s=1.0))
        for wid in ("w0", "w1"):
            await f.start_worker(
                ReferenceEngine(MODEL),
                WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.25, weight_transfer_backend="gloo"),
            )
        await f.wait_for_workers(["w0", "w1"])
        rl = await RLClient.connect(nats_server.url, prefix=subjects.prefix, timeout=30.0)
        await rl.pause()
        await rl.init_weight_transfer()
        updates = f.workers["w0"].updates
        commit = updates.commit

        async def commit_with_the_store_refusing(*a: object, **k: object) -> None:
            # phase 2: the decision is kept; every state write from here on is refused
            await capped_bucket(raw, subjects.kv_bucket, True)
            await commit(*a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(updates, "commit", commit_with_the_store_refusing)
        async with VersionEvents(rl) as events:
            # push_weights's steps up to its finish (its resume, a state write, comes after the store is back)
            await rl.push.start("main")
            await rl.push.update(trained(1), None)
            await rl.push.finish("v-late")  # answered: the decision stands
            await eventually(
                lambda: "the committed version's record was not kept" in caplog.text,
                timeout=15,
                what="the store refusing the record for its patience",
            )
            monkeypatch.undo()
            assert events.seen == [], "rl.version said a version the store did not have"
            await capped_bucket(raw, subjects.kv_bucket, False)
            assert await events.wait_for(1) == ["v-late"]
        assert await first_watched_version(rl) == "v-late"
        assert f.controller is not None
        decision = await f.controller.updates.store.decision()
        assert decision is not None and decision.weight_version == "v-late"
        assert decision.published, "the decision was not marked done: a successor would record it again"
        await rl.resume()
        assert (await rl.generate([1, 2, 3], 2)).weight_version == "v-late"
    finally:
        await capped_bucket(raw, subjects.kv_bucket, False)
        if rl is not None:
            await rl.close()
        await f.close()
