"""verify_weights / `rlbus verify`: every worker hashes the weights it serves; the controller
compares the replicas with each other and with the trainer's bits, and names any worker that
differs. Tested by corrupting one worker's live weights."""

from __future__ import annotations

import pytest
import torch

import rlbus
from tests.fleet import fleet_running
from tests.weights_helpers import MODEL, new_version, trained

WORKERS = ("v0", "v1", "v2")


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(
        nats_server.url, prefix + "verify", WORKERS, weight_transfer_backend="gloo", model=MODEL
    ) as f:
        yield f


async def test_every_replica_serves_the_trainers_bits_after_a_push(fleet):
    f, rl = fleet
    named = trained(3)
    await rl.push_weights(named, new_version("verify"))

    replicas = await rl.verify_weights()
    assert replicas.ok and replicas.reference == "replicas" and replicas.mismatched == []
    assert [w.worker_id for w in replicas.workers] == list(WORKERS)
    assert len({w.digest for w in replicas.workers}) == 1
    assert all(w.tensors == len(named) for w in replicas.workers)

    against = await rl.verify_weights(named)
    assert against.ok and against.reference == "trainer"


async def test_a_corrupted_worker_is_named_with_the_tensor_that_differs(fleet):
    f, rl = fleet
    named = trained(4)
    await rl.push_weights(named, new_version("verify"))
    name, live = next(iter(f.workers["v1"].engine.parameters_of("main").items()))
    with torch.no_grad():
        live.view(-1)[0] = live.view(-1)[0] + 1.0  # one element of the bits v1 serves

    replicas = await rl.verify_weights()
    assert not replicas.ok and replicas.mismatched == ["v1"]
    assert next(w for w in replicas.workers if w.worker_id == "v1").differs == [name]

    against = await rl.verify_weights(named)
    assert not against.ok and against.mismatched == ["v1"]

    await rl.push_weights(named, new_version("verify"))  # a push brings it back
    assert (await rl.verify_weights(named)).ok


async def test_the_trainers_other_tensors_name_every_worker(fleet):
    f, rl = fleet
    await rl.push_weights(trained(5), new_version("verify"))
    check = await rl.verify_weights(trained(6))
    assert not check.ok and check.reference == "trainer" and check.mismatched == list(WORKERS)


async def test_verify_of_a_draft_the_fleet_lacks_is_refused(fleet):
    _, rl = fleet
    with pytest.raises(rlbus.RLBusError) as e:
        await rl.verify_weights(draft=True)
    assert e.value.code in ("FAILED_PRECONDITION", "INVALID_ARGUMENT")
