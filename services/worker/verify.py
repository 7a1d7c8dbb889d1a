"""hash_weights: the checksum of every tensor a worker serves (for verify_weights)."""

from __future__ import annotations

from rlbus.schemas import FailedPrecondition, TensorChecksum, UpdateTarget

from rlbus.transfer.base import detached
from rlbus.transfer.buckets import as_bytes
from rlbus.transfer.checksum import checksum

from .engine import Engine


async def hash_weights(engine: Engine, target: UpdateTarget) -> list[TensorChecksum]:
    """xxh3-128 of each tensor's bytes, in name order, hashed in a thread (the loop keeps
    serving). The same checksum the trainer sends with finish, so the two compare directly."""
    status = engine.status()
    if target == "main" and ("weights" in status.sleeping_tags or not status.weights_loaded):
        raise FailedPrecondition(
            "weights are asleep or discarded here: wake them (and push after a level-2 sleep) first"
        )
    params = engine.parameters_of(target)  # refuses a target the engine does not have

    def run() -> list[TensorChecksum]:
        return [TensorChecksum(name=n, checksum=checksum(as_bytes(params[n].detach().cpu()))) for n in sorted(params)]

    return await detached(run, name="rlbus-hash")
