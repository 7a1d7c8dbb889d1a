"""The fleet heals itself: a worker behind the committed weights (newly started, restarted
under its id on its initial weights) is repaired from a healthy peer, verified against what
every healthy peer serves, committed as exactly the committed version and seq, and admitted to
generation, without a push. A peer whose bits differ from the others' is never a source.

In-process services (one per worker) on a real nats-server and real gloo groups; the tests
about frozen and killed processes are in test_repair_processes.py."""

from __future__ import annotations

import pytest
import torch
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from tests.fleet import fleet_running
from tests.waiting import FleetEvents, eventually
from tests.weights_helpers import MODEL, assert_holds, new_version, trained

WORKERS = ("r0", "r1")


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(
        nats_server.url, prefix + "repair", WORKERS, weight_transfer_backend="gloo", model=MODEL
    ) as f:
        yield f


async def start_worker(f, wid: str, seed: int = 0):
    """A worker on its own initial weights (a TinyLM of the fleet's shape, from `seed`)."""
    import msgspec

    subjects = f.controller.subjects
    engine = ReferenceEngine(msgspec.structs.replace(MODEL, seed=seed))
    return await f.start_worker(
        engine, WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.25, weight_transfer_backend="gloo")
    )


async def test_a_new_worker_serves_the_committed_version_without_a_push(fleet):
    f, rl = fleet
    named = trained(11)
    version = new_version("repair")
    await rl.push_weights(named, version)
    events = FleetEvents()
    sub = await rl.nc.subscribe(f.controller.subjects.event("worker_repaired"), cb=events.on)
    try:
        await start_worker(f, "r-new", seed=99)
        await eventually(lambda: events.of("worker_repaired", "r-new"), timeout=30, what="r-new repaired")
        info = await eventually(lambda: _serving(f, "r-new"), timeout=10, what="r-new serving")
        assert info
        assert_holds(f, "r-new", named)
        st = f.workers["r-new"].state()
        assert (st.weight_version, st.weight_seq) == (version, f.controller.version.seq)
        detail = events.of("worker_repaired", "r-new")[0].detail
        assert "source=r" in detail and f"seq={f.controller.version.seq}" in detail and "bytes=" in detail
        assert (await rl.verify_weights(named)).ok  # every worker, the new one included, serves the trainer's bits
    finally:
        await sub.unsubscribe()
        await f.stop(f.workers.pop("r-new"))


async def test_a_worker_restarted_on_its_initial_weights_is_repaired_and_the_next_push_is_a_delta(fleet):
    f, rl = fleet
    await rl.push_weights(trained(12), new_version("repair"), delta=True)  # tracked: the base of the next delta
    await f.stop(f.workers.pop("r1"))
    await start_worker(f, "r1")  # same id, initial weights
    await eventually(
        lambda: _serving(f, "r1") and f.workers["r1"].state().weight_seq == f.controller.version.seq,
        timeout=30,
        what="r1 repaired",
    )
    nxt = trained(13)
    await rl.push_weights(nxt, new_version("repair"), delta=True)
    last = rl.last_push
    assert last is not None and last.delta and last.fallback is None, last  # a delta for the whole fleet
    for w in WORKERS:
        assert_holds(f, w, nxt)


async def test_a_peer_whose_bits_differ_is_never_a_source(fleet):
    f, rl = fleet
    named = trained(14)
    await rl.push_weights(named, new_version("repair"))
    live = f.workers["r1"].engine.parameters_of("main")
    first = next(iter(live))
    with torch.no_grad():
        live[first].view(-1)[0] += 1.0  # r1 now serves other bits than r0
    events = FleetEvents()
    sub = await rl.nc.subscribe(f.controller.subjects.event("repair_failed"), cb=events.on)
    try:
        await start_worker(f, "r-new", seed=98)
        await eventually(lambda: events.of("repair_failed", "r-new"), timeout=30, what="repair refused")
        assert "do not serve the same" in events.of("repair_failed", "r-new")[0].detail
        assert f.workers["r-new"].state().withheld  # never served
        await rl.push_weights(named, new_version("repair"))  # a push brings r1 back (and r-new with it)
        await eventually(lambda: _serving(f, "r-new"), timeout=30, what="r-new serving after the push")
        assert (await rl.verify_weights(named)).ok
    finally:
        await sub.unsubscribe()
        await f.stop(f.workers.pop("r-new"))


class _CorruptsOneBucket:
    """A repair source's transport that flips one byte of the first bucket it sends, after the
    bucket's checksum was taken: what a bad link or bad memory on the wire does."""

    def __init__(self, tx) -> None:
        self._tx = tx
        self._sent: list[torch.Tensor] = []

    def send(self, buf: torch.Tensor):
        if not _CorruptsOneBucket.done:
            _CorruptsOneBucket.done = True
            buf = buf.clone()  # the source's own bits stay intact: only the copy on the wire is bad
            buf.view(torch.uint8)[buf.numel() // 2] ^= 0x10
            self._sent.append(buf)
        return self._tx.send(buf)

    def __getattr__(self, name: str):
        return getattr(self._tx, name)

    done = False


async def test_a_byte_corrupted_in_transit_aborts_the_repair_and_is_never_served(fleet, monkeypatch):
    from rlbus.services.worker import repair

    f, rl = fleet
    named = trained(15)
    await rl.push_weights(named, new_version("repair"))
    real = repair.trainer_transfer
    _CorruptsOneBucket.done = False
    monkeypatch.setattr(repair, "trainer_transfer", lambda backend: _CorruptsOneBucket(real(backend)))
    failed, repaired = FleetEvents(), FleetEvents()
    subs = [
        await rl.nc.subscribe(f.controller.subjects.event("repair_failed"), cb=failed.on),
        await rl.nc.subscribe(f.controller.subjects.event("worker_repaired"), cb=repaired.on),
    ]
    try:
        await start_worker(f, "r-bad", seed=97)
        await eventually(lambda: failed.of("repair_failed", "r-bad"), timeout=30, what="the corrupted repair aborted")
        assert _CorruptsOneBucket.done
        assert "checksum" in failed.of("repair_failed", "r-bad")[0].detail, failed.of("repair_failed", "r-bad")
        assert f.workers["r-bad"].state().withheld, "never served after a bad byte"
        assert not repaired.of("worker_repaired", "r-bad")
        # the retry (the next peer, or the same after its backoff) sends clean bytes
        await eventually(lambda: repaired.of("worker_repaired", "r-bad"), timeout=30, what="r-bad repaired")
        await eventually(lambda: _serving(f, "r-bad"), timeout=10, what="r-bad serving")
        assert_holds(f, "r-bad", named)
        assert (await rl.verify_weights(named)).ok
        kept = await f.controller.updates.store.decision()  # the manifest is kept with the decided commit now
        assert kept is not None and {c.name for c in kept.tensor_checksums} == {n for n, _ in named}
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await f.stop(f.workers.pop("r-bad"))


async def test_holders_that_disagree_with_the_decided_manifest_are_never_a_source(fleet):
    import msgspec
    from rlbus.schemas import TensorChecksum

    f, rl = fleet
    named = trained(16)
    await rl.push_weights(named, new_version("repair"))
    updates = f.controller.updates
    first = sorted(n for n, _ in named)[0]
    wrong = [TensorChecksum(name=first, checksum="0" * 32)]  # what the commit decided is not what they serve
    updates.decision = msgspec.structs.replace(updates.decision, tensor_checksums=wrong)
    events = FleetEvents()
    sub = await rl.nc.subscribe(f.controller.subjects.event("repair_failed"), cb=events.on)
    try:
        await start_worker(f, "r-new", seed=96)
        await eventually(lambda: events.of("repair_failed", "r-new"), timeout=30, what="repair refused")
        assert "decided commit's manifest" in events.of("repair_failed", "r-new")[0].detail
        assert f.workers["r-new"].state().withheld  # never served
    finally:
        await sub.unsubscribe()
        await f.stop(f.workers.pop("r-new"))
    await rl.push_weights(named, new_version("repair"))  # a new decision for the rest of the module


async def test_a_kept_manifest_catches_a_source_whose_bits_rotted_and_another_peer_repairs(fleet):
    f, rl = fleet
    named = trained(17)
    await rl.push_weights(named, new_version("repair"))
    repaired, failed = FleetEvents(), FleetEvents()
    subs = [
        await rl.nc.subscribe(f.controller.subjects.event("worker_repaired"), cb=repaired.on),
        await rl.nc.subscribe(f.controller.subjects.event("repair_failed"), cb=failed.on),
    ]
    try:
        await start_worker(f, "r-a", seed=95)  # the first repair after the commit keeps its manifest
        await eventually(lambda: repaired.of("worker_repaired", "r-a"), timeout=30, what="r-a repaired")
        await f.stop(f.workers.pop("r-a"))
        assert f.controller.updates.decision.manifest_complete
        live = f.workers["r0"].engine.parameters_of("main")  # r0, the first source, rots
        with torch.no_grad():
            live[sorted(live)[0]].view(-1)[0] += 1.0
        await start_worker(f, "r-b", seed=94)
        await eventually(lambda: failed.of("repair_failed", "r-b"), timeout=30, what="the rotten source refused")
        assert f.workers["r-b"].state().withheld  # never served
        await eventually(lambda: repaired.of("worker_repaired", "r-b"), timeout=30, what="r-b repaired by r1")
        assert "source=r1" in repaired.of("worker_repaired", "r-b")[0].detail
        assert_holds(f, "r-b", named)
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await f.stop(f.workers.pop("r-b"))
    await rl.push_weights(named, new_version("repair"))  # r0 back on the trainer's bits


async def test_server_info_names_no_repair_when_the_fleet_is_current(fleet):
    _, rl = fleet
    info = await rl.server_info()
    assert info.repairing == {} and info.repair_problem == ""


def _serving(f, wid: str) -> bool:
    w = f.workers.get(wid)
    return w is not None and not w.book.withheld and wid in f.controller.registry.ids()


async def test_a_new_worker_gets_the_committed_draft_too(nats_server, prefix):
    import msgspec

    from tests.fleet import SMALL

    draft_kw = {"draft_config": SMALL, "num_speculative_tokens": 2}
    async with fleet_running(
        nats_server.url,
        prefix + "repair-draft",
        ("d0",),
        weight_transfer_backend="gloo",
        model=MODEL,
        engine_kw=draft_kw,
    ) as (f, rl):
        main, draft = trained(15), trained(16, SMALL)
        await rl.push_weights(main, new_version("main"))
        await rl.push_weights(draft, new_version("draft"), draft=True)
        engine = ReferenceEngine(
            msgspec.structs.replace(MODEL, seed=97),
            draft_config=msgspec.structs.replace(SMALL, seed=96),
            num_speculative_tokens=2,
        )
        new = await f.start_worker(
            engine,
            WorkerOptions(
                worker_id="d-new", subjects=f.controller.subjects, heartbeat_s=0.25, weight_transfer_backend="gloo"
            ),
        )
        v = f.controller.version

        def both_repaired() -> bool:
            st = new.state()
            return (st.weight_seq, st.draft_seq, st.draft_version) == (
                v.seq,
                v.draft_seq,
                v.draft_version,
            ) and not st.withheld

        await eventually(both_repaired, timeout=30, what="main and draft repaired")
        assert_holds(f, "d-new", main)
        assert (await rl.verify_weights(draft, draft=True)).ok
