"""The worker's side of an update session alone, no NATS: WeightUpdates hosting a reference
engine. The session rules are checked without any group; the receives go through a real
shared-memory group whose trainer side runs in a thread of this process.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import torch
from rlbus.schemas import TensorChecksum, TransferInit, UpdateMode
from rlbus.schemas.errors import Aborted, FailedPrecondition, Internal, InvalidArgument
from rlbus.services.worker import updates as worker_updates
from rlbus.services.worker.book import Book
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.updates import WeightUpdates

from rlbus.transfer import TrainerTransfer, prepare, send_stream, trainer_transfer
from rlbus.transfer.buckets import as_bytes
from rlbus.transfer.checksum import checksum
from tests.weights_helpers import MODEL, Named, assert_engine_holds, engine_snapshot, trained

BUCKET = 4096
"""Small enough that the model travels in many buckets, some of them one tensor alone."""
RECEIVE_TIMEOUT_S = 10.0


def worker(mode: UpdateMode = "staged") -> WeightUpdates:
    engine, book = ReferenceEngine(MODEL), Book()
    engine.attach(book)
    return WeightUpdates(engine, book, "shm", mode)


@asynccontextmanager
async def shm_group(updates: WeightUpdates) -> AsyncIterator[TrainerTransfer]:
    """A two-rank shm group: the trainer (rank 0, returned) opens it in a thread while
    `updates` joins it as rank 1; both sides are closed afterwards."""
    tx = trainer_transfer("shm")
    bound = tx.bind(TransferInit(backend="shm", world_size=2, group_name=f"unit-{uuid.uuid4().hex[:8]}", timeout_s=10))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, tx.open, bound)
            await updates.join(bound, rank=1)
        yield tx
    finally:
        updates.teardown()
        tx.close()


async def send(updates: WeightUpdates, tx: TrainerTransfer, session_id: str, named: Named, tg) -> list[str]:
    """One update of `named`: the worker checks the metadata and starts receiving, the trainer
    streams the buckets from a thread; returns the trainer's checksums."""
    plan = prepare(named, BUCKET)
    updates.receive(session_id, plan.params, plan.buckets, tg)
    return await anyio.to_thread.run_sync(send_stream, tx, plan, named)


async def received_everything(updates: WeightUpdates) -> None:
    assert updates.session is not None
    with anyio.fail_after(RECEIVE_TIMEOUT_S):
        await updates.session.done.wait()
    assert updates.session.receiving == 0 and updates.session.failure is None


# ---- start -----------------------------------------------------------------------------------


async def test_start_refuses_a_second_session_and_is_idempotent_for_the_same_id():
    updates = worker()
    updates.start("s1", "main")
    updates.start("s1", "main")  # a retried start of the open session
    assert updates.session_id == "s1"

    with pytest.raises(FailedPrecondition) as err:
        updates.start("s2", "main")
    assert "s1" in err.value.message
    assert updates.session_id == "s1"


async def test_start_is_refused_while_the_weights_sleep_and_accepted_once_they_wake():
    updates = worker()
    await updates.engine.sleep(1, ["weights"])
    with pytest.raises(FailedPrecondition) as err:
        updates.start("s1", "main")
    assert "wake" in err.value.message
    assert updates.session is None

    await updates.engine.wake_up(["weights"])
    updates.start("s1", "main")
    assert updates.session_id == "s1"


# ---- check -----------------------------------------------------------------------------------


def _unknown(named: Named) -> tuple[Named, str, str]:
    return [*named, ("blocks.9.fc1.weight", torch.zeros(4))], "blocks.9.fc1.weight", "unknown parameter"


def _wrong_dtype(named: Named) -> tuple[Named, str, str]:
    victim = "blocks.0.qkv.bias"
    return (
        [(n, t.to(torch.bfloat16) if n == victim else t) for n, t in named],
        victim,
        "dtype bfloat16, model has float32",
    )


def _wrong_shape(named: Named) -> tuple[Named, str, str]:
    victim = "blocks.1.fc1.weight"
    bad = [(n, torch.zeros(t.shape[0] + 1, *t.shape[1:]) if n == victim else t) for n, t in named]
    return bad, victim, "shape [129, 32], model has [128, 32]"


@pytest.mark.parametrize(
    "spoil", [_unknown, _wrong_dtype, _wrong_shape], ids=["unknown-name", "wrong-dtype", "wrong-shape"]
)
async def test_metadata_that_does_not_match_the_model_is_refused_naming_the_tensor_before_any_byte_moves(spoil):
    updates = worker()
    before = engine_snapshot(updates.engine)
    bad, victim, why = spoil(trained(1))
    plan = prepare(bad, BUCKET)
    updates.start("s1", "main")

    with pytest.raises(InvalidArgument) as err:
        updates.check("s1", plan.params, plan.buckets)
    assert f"{victim} ({why})" in err.value.message
    async with anyio.create_task_group() as tg:
        # receive() checks first: no group is needed to refuse, and no receive starts
        with pytest.raises(InvalidArgument) as err:
            updates.receive("s1", plan.params, plan.buckets, tg)
    assert victim in err.value.message

    assert updates.session is not None and updates.session.receiving == 0
    assert not updates.session.received and not updates.session.checksums
    assert_engine_holds(updates.engine, before)
    assert updates.session_id == "s1", "a refused check leaves the session open"


# ---- commit ----------------------------------------------------------------------------------


async def test_commit_without_an_open_session_is_refused():
    updates = worker()
    with pytest.raises(FailedPrecondition):
        await updates.commit("s1", "v1", 1)
    assert updates.book.main.version == "default"


async def test_a_commit_that_moved_no_byte_commits_its_version_without_trimming_memory(monkeypatch):
    trims: list[bool] = []
    monkeypatch.setattr(worker_updates, "release_freed_memory", lambda: trims.append(True))
    updates = worker()
    updates.start("s1", "main")
    await updates.prepare("s1", RECEIVE_TIMEOUT_S)
    await updates.commit("s1", "v1", 1)
    assert (updates.book.main.version, updates.book.main.seq) == ("v1", 1) and updates.session is None
    assert not trims, "an empty session trimmed the process's memory (a thread and a malloc_trim per worker)"


async def test_commit_for_another_session_id_is_refused_and_the_open_session_stays():
    updates = worker()
    updates.start("s1", "main")
    with pytest.raises(FailedPrecondition) as err:
        await updates.commit("s2", "v1", 1)
    assert "s2" in err.value.message and "s1" in err.value.message
    assert updates.session_id == "s1"
    assert updates.book.main.version == "default"


async def test_commit_of_received_bytes_without_a_prepare_is_refused():
    updates = worker()
    before = engine_snapshot(updates.engine)
    async with shm_group(updates) as tx:
        updates.start("s1", "main")
        async with anyio.create_task_group() as tg:
            await send(updates, tx, "s1", trained(2), tg)
        await received_everything(updates)

        with pytest.raises((FailedPrecondition, Internal)):
            await updates.commit("s1", "v1", 1)
    assert_engine_holds(updates.engine, before)
    assert updates.book.main.version == "default"


# ---- abort -----------------------------------------------------------------------------------


async def test_aborting_an_in_place_session_that_touched_the_weights_marks_the_engine_dirty():
    updates = worker("in_place")
    async with shm_group(updates) as tx:
        updates.start("s1", "main")
        async with anyio.create_task_group() as tg:
            await send(updates, tx, "s1", trained(3), tg)
        await received_everything(updates)

        assert updates.abort("s1")
    assert updates.session is None
    assert updates.book.dirty
    assert updates.book.main.version == "default"


async def test_aborting_a_staged_session_after_every_byte_arrived_leaves_the_weights_bit_identical():
    updates = worker("staged")
    before = engine_snapshot(updates.engine)
    async with shm_group(updates) as tx:
        updates.start("s1", "main")
        async with anyio.create_task_group() as tg:
            await send(updates, tx, "s1", trained(4), tg)
        await received_everything(updates)
        assert updates.session is not None and updates.session.received, "the bytes arrived"

        assert updates.abort("s1")
    assert updates.session is None
    assert not updates.book.dirty
    assert_engine_holds(updates.engine, before)
    assert updates.book.main.version == "default"


# ---- set_version -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["", "   ", "x" * 129, "step\n1", "tab\there"], ids=["empty", "blank", "too-long", "newline", "tab"]
)
async def test_set_version_refuses_an_invalid_version(bad):
    updates = worker()
    with pytest.raises(InvalidArgument):
        updates.set_version(bad, 1)
    assert updates.book.main.version == "default"


async def test_set_version_is_refused_while_a_session_is_open():
    updates = worker()
    updates.start("s1", "main")
    with pytest.raises(FailedPrecondition) as err:
        updates.set_version("v1", 1)
    assert "s1" in err.value.message
    assert updates.book.main.version == "default"

    assert updates.abort("s1")
    updates.set_version("v1", 1)
    assert updates.book.main.version == "v1"


# ---- the whole update ------------------------------------------------------------------------


async def test_an_empty_update_commits_without_a_transfer_group_and_takes_the_version():
    updates = worker()
    before = engine_snapshot(updates.engine)
    assert not updates.transfer_ready
    updates.start("s1", "main")
    async with anyio.create_task_group() as tg:
        updates.receive("s1", [], [], tg)
    await updates.prepare("s1", RECEIVE_TIMEOUT_S, [])
    await updates.commit("s1", "v1", 1)

    assert updates.session is None
    assert updates.book.main.version == "v1"
    assert_engine_holds(updates.engine, before)


async def test_a_received_update_over_shm_commits_the_sent_tensors_and_the_version():
    updates = worker("staged")
    named = trained(5)
    async with shm_group(updates) as tx:
        updates.start("s1", "main")
        async with anyio.create_task_group() as tg:
            checksums = await send(updates, tx, "s1", named, tg)
        assert len(checksums) > 1, "the update travelled in several buckets"

        await updates.prepare("s1", RECEIVE_TIMEOUT_S, checksums)
        await updates.commit("s1", "v1", 1)
    assert updates.session is None
    assert_engine_holds(updates.engine, named)
    assert updates.book.main.version == "v1"
    assert not updates.book.dirty


async def test_prepare_with_a_wrong_checksum_aborts_and_changes_nothing():
    updates = worker("staged")
    before = engine_snapshot(updates.engine)
    async with shm_group(updates) as tx:
        updates.start("s1", "main")
        async with anyio.create_task_group() as tg:
            checksums = await send(updates, tx, "s1", trained(6), tg)
        wrong = [*checksums[:1], "0" * 32, *checksums[2:]]

        with pytest.raises(Aborted) as err:
            await updates.prepare("s1", RECEIVE_TIMEOUT_S, wrong)
        assert "checksum" in err.value.message
        assert_engine_holds(updates.engine, before)
        assert updates.book.main.version == "default"
        with pytest.raises(Internal):  # a failed prepare cannot be committed
            await updates.commit("s1", "v1", 1)
    assert_engine_holds(updates.engine, before)
    assert updates.book.main.version == "default"


# ---- a repair from a peer --------------------------------------------------------------------


def manifest(named: Named) -> list[TensorChecksum]:
    """The commit's manifest as the controller keeps it: every tensor's checksum."""
    return [TensorChecksum(name=n, checksum=checksum(as_bytes(t))) for n, t in named]


async def test_a_repair_of_a_withheld_staged_worker_lands_in_its_live_weights_and_commits_against_the_manifest():
    updates = worker("staged")
    assert updates.book.withheld, "a worker that has not synced is withheld"
    where = {n: p.data_ptr() for n, p in updates.engine.model.named_parameters()}
    named = trained(7)
    async with shm_group(updates) as tx:
        updates.start("r1", "main", repair=True)
        async with anyio.create_task_group() as tg:
            await send(updates, tx, "r1", named, tg)
        await received_everything(updates)
        assert updates.session is not None and not updates.session.staged, "no shadow copy was held"

        await updates.prepare("r1", RECEIVE_TIMEOUT_S, [], tensor_checksums=manifest(named))
        await updates.commit("r1", "v1", 3)
    assert_engine_holds(updates.engine, named)
    assert {n: p.data_ptr() for n, p in updates.engine.model.named_parameters()} == where, "received in place"
    assert (updates.book.main.version, updates.book.main.seq) == ("v1", 3) and not updates.book.dirty


async def test_a_repair_whose_bytes_are_not_the_manifest_is_refused_leaving_the_worker_dirty_and_withheld():
    updates = worker("staged")
    async with shm_group(updates) as tx:
        updates.start("r1", "main", repair=True)
        async with anyio.create_task_group() as tg:
            await send(updates, tx, "r1", trained(8), tg)
        with pytest.raises(Aborted) as err:
            await updates.prepare("r1", RECEIVE_TIMEOUT_S, [], tensor_checksums=manifest(trained(9)))
        assert "not bit-identical" in err.value.message
        with pytest.raises(Internal):
            await updates.commit("r1", "v1", 3)
        assert updates.abort("r1")
    assert updates.book.dirty and updates.book.withheld, "half-written: never served, never a delta base"
    assert updates.book.main.version == "default"


async def _repaired_without(manifest_of: list[TensorChecksum]) -> Aborted:
    """A repair of one withheld worker, prepared against `manifest_of`: the refusal."""
    updates = worker("staged")
    async with shm_group(updates) as tx:
        updates.start("r1", "main", repair=True)
        async with anyio.create_task_group() as tg:
            await send(updates, tx, "r1", trained(10), tg)
        with pytest.raises(Aborted) as err:
            await updates.prepare("r1", RECEIVE_TIMEOUT_S, [], tensor_checksums=manifest_of)
    return err.value


async def test_a_repair_must_name_every_received_tensor_in_its_manifest():
    named = trained(10)
    assert named[0][0] in (await _repaired_without(manifest(named)[1:])).message
    assert "manifest" in (await _repaired_without([])).message


async def test_a_repair_of_a_worker_that_serves_keeps_its_weights_aside_until_the_commit():
    updates = worker("staged")
    updates.book.withhold(False)
    before = engine_snapshot(updates.engine)
    async with shm_group(updates) as tx:
        updates.start("r1", "main", repair=True)
        async with anyio.create_task_group() as tg:
            await send(updates, tx, "r1", trained(11), tg)
        await received_everything(updates)
        assert updates.session is not None and updates.session.staged, "staged while it serves"
        assert_engine_holds(updates.engine, before)
        assert updates.abort("r1")
    assert_engine_holds(updates.engine, before)
    assert not updates.book.dirty
