"""The weight-update correctness scenarios of test_weight_updates.py, over shared memory."""

from __future__ import annotations

import pytest

from tests.fleet import fleet_running
from tests.weights_helpers import (
    MODEL,
    check_corrupted_bytes_abort_the_finish,
    check_explicit_lifecycle_in_two_updates,
    check_level_2_sleep_then_push,
    check_push_weights_is_bit_identical,
    check_shape_mismatch_is_refused_before_bytes_move,
    check_staged_abort_keeps_generation,
    settle,
)


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, weight_transfer_backend="shm", model=MODEL) as running:
        yield running


@pytest.fixture(autouse=True)
async def settled(fleet):
    yield
    await settle(fleet[1])


async def test_push_weights_over_shm_makes_every_worker_bit_identical_to_the_trainer(fleet):
    f, rl = fleet
    await check_push_weights_is_bit_identical(f, rl, seed=7)
    assert all(w.capabilities.weight_transfer_backend == "shm" for w in (await rl.server_info()).workers)


async def test_explicit_lifecycle_over_shm_commits_two_updates_and_finish_none_keeps_the_version(fleet):
    await check_explicit_lifecycle_in_two_updates(*fleet, seed=11)


async def test_level_2_sleep_then_push_over_shm_serves_the_pushed_model(fleet):
    await check_level_2_sleep_then_push(*fleet, seed=41)


async def test_staged_abort_over_shm_keeps_weights_version_and_output(fleet):
    await check_staged_abort_keeps_generation(*fleet, seed=51)


async def test_corrupted_bytes_over_shm_abort_the_finish_and_keep_the_old_weights(fleet):
    await check_corrupted_bytes_abort_the_finish(*fleet, seed=61)


async def test_shape_mismatch_over_shm_is_refused_naming_the_tensor_before_any_byte_moves(fleet):
    await check_shape_mismatch_is_refused_before_bytes_move(*fleet, seed=71)


async def test_the_trainer_packs_straight_into_shared_memory_so_workers_copy_once(fleet):
    f, rl = fleet
    await check_push_weights_is_bit_identical(f, rl, seed=81)
    assert rl.push.transfer is not None and len(rl.push.scratch) == 2
    assert all(rl.push.transfer.holds(b) for b in rl.push.scratch), "the packing buffers are not the transport's shared memory"
