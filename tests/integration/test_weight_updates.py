"""Weight-update sessions on an in-process fleet: the trainer's ranks and the workers' ranks
are threads of this process, the metadata goes through a real controller.

One fleet per backend serves the happy paths: the scenarios every transport must pass run
over gloo and over shm; the control-plane rules, which do not depend on the transport, run
over one (`over_one_backend`); tests that need another configuration or break state start
a small fleet of their own under a prefix of their own.
"""

from __future__ import annotations

import sys

import anyio
import pytest
import torch
from rlbus.schemas import FleetAck, KvKey, StartWeightUpdate, Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.models.tinylm import ModelConfig
from tests.fleet import fleet_running, nccl_worker, start_fleet
from tests.waiting import eventually
from tests.weights_helpers import (
    MODEL,
    VersionEvents,
    assert_holds,
    check_corrupted_bytes_abort_the_finish,
    check_explicit_lifecycle_in_two_updates,
    check_level_2_sleep_then_push,
    check_push_weights_is_bit_identical,
    check_shape_mismatch_is_refused_before_bytes_move,
    check_staged_abort_keeps_generation,
    first_watched_version,
    generate_all,
    greedy,
    new_version,
    received_everything,
    send_corrupted,
    settled,  # noqa: F401 - the autouse fixture around every test
    snapshot,
    tokens_of,
    trained,
)

BACKENDS = ["gloo", "shm"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    """The transport of the module's fleet: one fleet per backend, each started once."""
    return request.param


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix, backend):
    async with fleet_running(
        nats_server.url, prefix + backend, weight_transfer_backend=backend, model=MODEL
    ) as running:
        yield running


over_one_backend = pytest.mark.parametrize("backend", ["gloo"], indirect=True)
"""A control-plane rule: the transport under the session does not change it."""
only_over_shm = pytest.mark.parametrize("backend", ["shm"], indirect=True)


async def _own_fleet(nats_server, prefix: str, **kw):
    return await start_fleet(nats_server.url, prefix, model=MODEL, **kw)


async def _close(f, rl) -> None:
    await rl.close()
    await f.close()


# ---- the happy path ------------------------------------------------------------------------


async def test_push_weights_makes_every_worker_bit_identical_to_the_trainer(fleet, backend):
    f, rl = fleet
    await check_push_weights_is_bit_identical(f, rl, seed=7)
    assert all(w.capabilities.weight_transfer_backend == backend for w in (await rl.server_info()).workers)


async def test_explicit_lifecycle_commits_two_updates_and_finish_none_keeps_the_version(fleet):
    await check_explicit_lifecycle_in_two_updates(*fleet, seed=11)


@over_one_backend
async def test_version_is_published_once_per_successful_finish_and_never_for_a_failed_one(fleet):
    f, rl = fleet
    async with VersionEvents(rl) as events:
        first = new_version("pub")
        await rl.push_weights(trained(21), first)
        assert await events.wait_for(1) == [first]

        await rl.start_weight_update()
        await send_corrupted(rl, trained(22), bucket_bytes=4096)
        with pytest.raises(rlbus.Aborted):
            await rl.finish_weight_update("pub-failed")

        second = new_version("pub")
        await rl.update_weight_version(second)
        # in publish order: a message for the failed finish would sit between the two
        assert await events.wait_for(2) == [first, second]
        assert len(events.seen) == 2
        assert events.seen[0].session_id is not None and events.seen[1].session_id is None


@over_one_backend
async def test_watch_versions_yields_the_current_version_first_then_each_new_one(fleet):
    f, rl = fleet
    current = (await rl.server_info()).weight_version
    a, b = new_version("watch"), new_version("watch")
    agen = rl.watch_versions()
    try:
        with anyio.fail_after(20):
            assert (await agen.__anext__()).version == current
            await rl.push_weights(trained(31), a)
            assert (await agen.__anext__()).version == a
            await rl.update_weight_version(b)
            assert (await agen.__anext__()).version == b
    finally:
        await agen.aclose()


async def test_level_2_sleep_then_wake_weights_push_and_wake_kv_cache_serves_the_pushed_model(fleet):
    await check_level_2_sleep_then_push(*fleet, seed=41)


async def test_staged_abort_after_every_byte_arrived_keeps_weights_version_and_output(fleet):
    await check_staged_abort_keeps_generation(*fleet, seed=51)


# ---- failures that change nothing ----------------------------------------------------------


async def test_corrupted_bytes_abort_the_finish_on_every_worker_and_keep_the_old_weights(fleet):
    await check_corrupted_bytes_abort_the_finish(*fleet, seed=61)


async def test_shape_mismatch_is_refused_naming_the_tensor_before_any_byte_moves(fleet):
    await check_shape_mismatch_is_refused_before_bytes_move(*fleet, seed=71)


@only_over_shm
async def test_the_trainer_packs_straight_into_shared_memory_so_workers_copy_once(fleet):
    f, rl = fleet
    await check_push_weights_is_bit_identical(f, rl, seed=81)
    assert rl.push.transfer is not None and len(rl.push.scratch) == 2
    assert all(rl.push.transfer.holds(b) for b in rl.push.scratch), (
        "the packing buffers are not the transport's shared memory"
    )


@over_one_backend
async def test_a_finish_without_the_senders_checksums_aborts_and_changes_nothing(fleet):
    """The bytes arrived, but the finish carries no checksums for them (it did not come from
    the client that sent them): nothing can be verified, so nothing is committed."""
    f, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    old = {w: snapshot(f, w) for w in f.workers}
    version = (await rl.server_info()).weight_version
    await rl.start_weight_update()
    await rl.update_weights(trained(65))
    assert rl.push.checksums, "the client kept the checksums of what it sent"
    rl.push.checksums = rl.push.checksums[:-1]  # one bucket short
    with pytest.raises(rlbus.Aborted) as err:
        await rl.finish_weight_update(new_version("unverified"))
    assert "checksum" in err.value.message and sorted(err.value.workers) == sorted(f.workers)
    for wid in f.workers:
        assert_holds(f, wid, old[wid])
    assert (await rl.server_info()).weight_version == version
    assert await first_watched_version(rl) == version


@over_one_backend
async def test_an_update_split_into_several_metadata_messages_commits_with_every_checksum_in_order(fleet, monkeypatch):
    f, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    # leave 1000 bytes of the server's max_payload to each metadata message: a few tensors each
    monkeypatch.setattr(rlbus.sdk.push, "META_HEADROOM", rl.nc.max_payload - 1000)
    named = trained(67)
    await rl.start_weight_update()
    await rl.update_weights(named, bucket_bytes=4096)
    sessions = [w.updates.session for w in f.workers.values()]
    assert all(s is not None and len(s.checksums) > 2 for s in sessions), "the update went out in several streams"
    await rl.finish_weight_update(new_version("split"))
    for wid in f.workers:
        assert_holds(f, wid, named)


@over_one_backend
async def test_a_tensor_whose_metadata_cannot_fit_one_message_is_invalid_argument_and_changes_nothing(fleet):
    f, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    await rl.start_weight_update()
    try:
        with pytest.raises(rlbus.InvalidArgument, match="max_payload"):
            await rl.update_weights([("x" * rl.nc.max_payload, torch.zeros(2))])
        assert all(s.updates.session is not None and not s.updates.session.received for s in f.workers.values())
    finally:
        await rl.abort_weight_update("test over")


@over_one_backend
async def test_malformed_checksums_are_refused_and_the_session_stays_open(fleet):
    f, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    await rl.start_weight_update()
    await rl.update_weights(trained(66))
    rl.push.checksums = [c.upper() for c in rl.push.checksums]
    with pytest.raises(rlbus.InvalidArgument) as err:
        await rl.finish_weight_update(new_version("malformed"))
    assert "hex" in err.value.message
    assert (await rl.server_info()).session_id is not None, "a refused finish leaves the session open"
    rl.push.checksums = [c.lower() for c in rl.push.checksums]
    named = trained(66)
    await rl.finish_weight_update(new_version("well-formed"))
    for wid in f.workers:
        assert_holds(f, wid, named)


# ---- refusals ------------------------------------------------------------------------------


@over_one_backend
async def test_finish_without_start_is_refused(fleet):
    _, rl = fleet
    with pytest.raises(rlbus.FailedPrecondition) as err:
        await rl.finish_weight_update("nope")
    assert err.value.code == "FAILED_PRECONDITION"


@over_one_backend
async def test_starting_a_second_session_is_refused_and_the_first_stays_open(fleet):
    _, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    first = await rl.start_weight_update()
    with pytest.raises(rlbus.FailedPrecondition) as err:
        await rl.start_weight_update()
    assert err.value.code == "FAILED_PRECONDITION"
    assert (await rl.server_info()).session_id == first.session_id


@over_one_backend
async def test_a_start_the_workers_refuse_leaves_no_session_record_and_no_push_lease(fleet, raw, prefix):
    f, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    await rl.abort_weight_update()  # no session open, and the push lease free
    # the record and the lease are written beside the start's fan-out: a refusal takes both back
    with pytest.raises(rlbus.FailedPrecondition, match="cannot apply a delta"):
        await rl.call(StartWeightUpdate(base_seq=10**6), FleetAck)
    kv = await raw.jetstream().key_value(Subjects(prefix + "gloo").kv_bucket)
    assert (await kv.get(KvKey.SESSION)).value == b"null", "a session that never opened is on record"
    assert (await kv.get(KvKey.PUSH_LEASE)).value == b"null", "the refused start kept the push lease"
    info = await rl.server_info()
    assert info.session_id is None and info.push_lease is None
    assert not any(w.state.session_id for w in info.workers)


@over_one_backend
async def test_update_without_a_session_is_refused(fleet):
    _, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    with pytest.raises(rlbus.FailedPrecondition) as err:
        await rl.update_weights(trained(81))
    assert err.value.code == "FAILED_PRECONDITION"


async def test_update_before_init_weight_transfer_is_refused_by_the_client(nats_server, prefix):
    f, rl = await _own_fleet(nats_server, prefix + "n", worker_ids=["w0"], weight_transfer_backend="gloo")
    try:
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.update_weights(trained(82))
        assert err.value.code == "FAILED_PRECONDITION"
        assert "init_weight_transfer" in err.value.message
    finally:
        await _close(f, rl)


@over_one_backend
async def test_start_while_weights_sleep_is_refused_until_they_wake(fleet):
    f, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    await rl.sleep(level=1)
    with pytest.raises(rlbus.FailedPrecondition) as err:
        await rl.start_weight_update()
    assert err.value.code == "FAILED_PRECONDITION"
    assert "wake" in err.value.message
    assert (await rl.server_info()).session_id is None

    await rl.wake_up()
    started = await rl.start_weight_update()
    assert started.session_id
    await rl.abort_weight_update()


@over_one_backend
async def test_setting_the_version_while_a_session_is_open_is_refused(fleet):
    _, rl = fleet
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    version = (await rl.server_info()).weight_version
    await rl.start_weight_update()
    with pytest.raises(rlbus.FailedPrecondition) as err:
        await rl.update_weight_version(new_version("during"))
    assert err.value.code == "FAILED_PRECONDITION"
    await rl.abort_weight_update()
    assert await rl.get_weight_version() == version


@over_one_backend
@pytest.mark.parametrize(
    "bad", ["", "   ", "x" * 129, "step\n1", "tab\there"], ids=["empty", "blank", "too-long", "newline", "tab"]
)
async def test_invalid_version_strings_are_refused(fleet, bad):
    _, rl = fleet
    version = (await rl.server_info()).weight_version
    with pytest.raises(rlbus.InvalidArgument) as err:
        await rl.update_weight_version(bad)
    assert err.value.code == "INVALID_ARGUMENT"
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    await rl.start_weight_update()
    with pytest.raises(rlbus.InvalidArgument) as err:
        await rl.finish_weight_update(bad)
    assert err.value.code == "INVALID_ARGUMENT"
    assert (await rl.server_info()).session_id is not None, "a refused version leaves the session open"
    await rl.abort_weight_update()
    assert await rl.get_weight_version() == version


async def test_init_weight_transfer_without_a_backend_is_refused(nats_server, prefix):
    f, rl = await _own_fleet(nats_server, prefix + "none", worker_ids=["w0"])
    try:
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.init_weight_transfer(timeout_s=1)
        assert err.value.code == "FAILED_PRECONDITION"
        with pytest.raises(rlbus.FailedPrecondition) as err:  # naming one does not help
            await rl.init_weight_transfer("gloo", timeout_s=1)
        assert err.value.workers == [] and "w0" in err.value.message
        assert not rl.transfer_ready
    finally:
        await _close(f, rl)


async def test_init_weight_transfer_on_workers_with_different_backends_is_refused(nats_server, prefix):
    p = prefix + "mixed"
    f, rl = await _own_fleet(nats_server, p, worker_ids=["w0"], weight_transfer_backend="gloo")
    try:
        await f.start_worker(
            ReferenceEngine(MODEL),
            WorkerOptions(worker_id="w1", subjects=Subjects(prefix=p), heartbeat_s=0.25, weight_transfer_backend="shm"),
        )
        await f.wait_for_workers(["w0", "w1"])
        assert (await rl.server_info()).capabilities.weight_transfer_backend is None
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.init_weight_transfer(timeout_s=1)
        assert err.value.code == "FAILED_PRECONDITION"
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.init_weight_transfer("gloo", timeout_s=1)
        assert "w0" in err.value.message and "w1" in err.value.message
        assert not rl.transfer_ready
        assert all(not w.state.transfer_ready for w in (await rl.server_info()).workers)
    finally:
        await _close(f, rl)


def _threads_forming_a_group() -> list[int]:
    """Ids of threads blocked in a transfer group's rendezvous (TorchDist _form)."""
    return [
        tid
        for tid, frame in sys._current_frames().items()
        if any(f.f_code.co_name == "_form" and f.f_code.co_filename.endswith("torchdist.py") for f in _stack(frame))
    ]


def _stack(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


async def test_a_refused_init_weight_transfer_leaves_no_thread_waiting_for_the_group(nats_server, prefix):
    f, rl = await _own_fleet(nats_server, prefix + "leak", worker_ids=["w0"])
    try:
        with pytest.raises(rlbus.FailedPrecondition):
            await rl.init_weight_transfer("gloo", timeout_s=3)
        # the refusal is final: the trainer's rank 0 must not keep its rendezvous open until timeout_s
        await eventually(lambda: not _threads_forming_a_group(), timeout=2.5, what="no thread still forming the group")
    finally:
        await _close(f, rl)


async def test_a_nack_from_one_worker_names_only_that_worker(nats_server, prefix):
    p = prefix + "shape"
    f, rl = await _own_fleet(nats_server, p, worker_ids=["w0"], weight_transfer_backend="gloo")
    try:
        await f.start_worker(
            ReferenceEngine(ModelConfig(vocab_size=64, d_model=48, n_layers=2, n_heads=4, max_seq_len=128)),
            WorkerOptions(
                worker_id="w1", subjects=Subjects(prefix=p), heartbeat_s=0.25, weight_transfer_backend="gloo"
            ),
        )
        await f.wait_for_workers(["w0", "w1"])
        w0_before = snapshot(f, "w0")
        with pytest.raises(rlbus.InvalidArgument) as err:
            await rl.push_weights(trained(91), new_version("one-nack"))
        assert err.value.code == "INVALID_ARGUMENT"
        assert err.value.workers == ["w1"]
        assert_holds(f, "w0", w0_before)
        info = await rl.server_info()
        assert info.session_id is None and info.weight_version == "default"
        assert all(w.state.session_id is None for w in info.workers)
    finally:
        await _close(f, rl)


@over_one_backend
async def test_get_weight_version_names_the_workers_that_disagree(fleet):
    f, rl = fleet
    committed = await rl.get_weight_version()
    w1 = f.workers["w1"].book
    seq = w1.main.seq
    w1.relabel("rogue", seq)
    try:
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.get_weight_version()
        assert err.value.code == "FAILED_PRECONDITION"
        assert "rogue: ['w1']" in err.value.message
        assert f"{committed}: ['w0']" in err.value.message
    finally:
        w1.relabel(committed, seq)
    assert await rl.get_weight_version() == committed


# ---- in_place mode -------------------------------------------------------------------------


async def test_in_place_abort_after_bytes_arrived_leaves_workers_dirty_until_a_push_commits(nats_server, prefix):
    f, rl = await _own_fleet(nats_server, prefix + "inplace", weight_transfer_backend="gloo", update_mode="in_place")
    try:
        first, second = trained(101), trained(102)
        v1 = new_version("inplace")
        await rl.push_weights(first, v1)
        for wid in f.workers:
            assert_holds(f, wid, first)
        assert tokens_of(await generate_all(rl)) == greedy(first)

        await rl.pause("wait")  # in place, bytes land in the live weights: nothing may be served meanwhile
        await rl.start_weight_update()
        await rl.update_weights(second)
        await received_everything(f)
        aborted = await rl.abort_weight_update("abandon")
        assert all(w.dirty for w in aborted.workers)
        info = await rl.server_info()
        assert all(w.state.dirty for w in info.workers)
        assert info.weight_version == v1
        await rl.resume()
        with pytest.raises(rlbus.FailedPrecondition) as err:
            await rl.generate([1, 2, 3], 4)
        assert err.value.code == "FAILED_PRECONDITION"

        v2 = new_version("inplace")
        done = await rl.push_weights(first, v2)
        assert not any(w.dirty for w in done.workers)
        assert not any(w.state.dirty for w in (await rl.server_info()).workers)
        for wid in f.workers:
            assert_holds(f, wid, first)
        replies = await generate_all(rl)
        assert tokens_of(replies) == greedy(first) and all(r.weight_version == v2 for r in replies)
    finally:
        await _close(f, rl)


async def test_in_place_corrupted_bucket_aborts_and_leaves_workers_dirty(nats_server, prefix):
    f, rl = await _own_fleet(nats_server, prefix + "inplacebad", weight_transfer_backend="gloo", update_mode="in_place")
    try:
        await rl.init_weight_transfer(timeout_s=10)
        await rl.pause("wait")
        await rl.start_weight_update()
        sent = await send_corrupted(rl, trained(111), bucket_bytes=4096, bad_bucket=3)
        assert sent > 4  # good buckets before and after the bad one reached the live parameters
        with pytest.raises(rlbus.Aborted) as err:
            await rl.finish_weight_update("bad")
        assert sorted(err.value.workers) == ["w0", "w1"]
        assert all(w.state.dirty for w in (await rl.server_info()).workers)
        assert await first_watched_version(rl) == "default"
        await rl.resume()
        with pytest.raises(rlbus.FailedPrecondition):
            await rl.generate([1, 2, 3], 4)

        good = trained(112)
        await rl.push_weights(good, new_version("inplace-ok"))
        for wid in f.workers:
            assert_holds(f, wid, good)
        assert tokens_of(await generate_all(rl)) == greedy(good)
    finally:
        await _close(f, rl)


async def test_in_place_nothing_uncommitted_is_served_while_a_session_is_open(nats_server, prefix):
    f, rl = await _own_fleet(
        nats_server, prefix + "inplaceopen", weight_transfer_backend="gloo", update_mode="in_place"
    )
    try:
        old = await rl.generate([1, 2, 3], 4)
        await rl.init_weight_transfer(timeout_s=10)
        with pytest.raises(rlbus.FailedPrecondition, match="not paused"):
            await rl.start_weight_update()  # a running fleet would serve half-written weights
        await rl.pause("wait")
        await rl.start_weight_update()
        new = trained(121)
        await rl.update_weights(new)
        await received_everything(f)
        with pytest.raises(rlbus.FailedPrecondition, match="finish or abort"):
            await rl.resume()
        assert await rl.is_paused()
        version = new_version("inplace-open")
        await rl.finish_weight_update(version)
        await rl.resume()
        replies = await generate_all(rl)
        assert all(r.weight_version == version and r.weight_seq == old.weight_seq + 1 for r in replies)
        assert tokens_of(replies) == greedy(new)
    finally:
        await _close(f, rl)


# ---- durability ----------------------------------------------------------------------------


async def test_committed_version_survives_a_controller_restart(nats_server, prefix):
    p = prefix + "restart"
    f, rl = await _own_fleet(nats_server, p, weight_transfer_backend="gloo")
    try:
        version = new_version("durable")
        named = trained(121)
        await rl.push_weights(named, version)
        before = await rl.server_info()

        assert f.controller is not None
        await f.stop(f.controller)
        await f.start_controller(
            ControllerOptions(subjects=Subjects(prefix=p), command_timeout_s=10, liveness_timeout_s=1.5)
        )
        await f.wait_for_workers(["w0", "w1"])

        after = await rl.server_info()
        assert after.weight_version == version
        assert after.epoch > before.epoch
        assert after.controller_id != before.controller_id
        assert await first_watched_version(rl) == version
        assert await rl.get_weight_version() == version
        for wid in f.workers:
            assert_holds(f, wid, named)
        # the new controller can run the next session
        await rl.push_weights(trained(122), new_version("durable"))
    finally:
        await _close(f, rl)


# ---- nccl (GPU machines only) --------------------------------------------------------------


@pytest.mark.gpu
async def test_push_weights_over_nccl_reaches_a_worker_process(nats_server, prefix):
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl needs the trainer and the worker on different GPUs")
    p = prefix + "nccl"
    f, rl = await _own_fleet(nats_server, p, worker_ids=[])
    try:
        with nccl_worker(nats_server.url, p, "gpu0", MODEL):
            with anyio.fail_after(90):
                await f.wait_for_workers(["gpu0"])
            torch.cuda.set_device(0)
            named = [(n, t.to("cuda:0")) for n, t in trained(131)]
            version = new_version("nccl")
            await rl.init_weight_transfer("nccl", timeout_s=60)
            ack = await rl.push_weights(named, version)
            assert ack.weight_version == version
            replies = await generate_all(rl)
            assert tokens_of(replies) == greedy([(n, t.cpu()) for n, t in named])
            assert all(r.weight_version == version and r.worker_id == "gpu0" for r in replies)
    finally:
        await _close(f, rl)
