"""rlbus.transfer — the out-of-band tensor data plane (torch; never nats).

Trainer side::

    tx = trainer_transfer(init.backend)
    bound = tx.bind(init)             # free port chosen; send `bound` to workers over NATS
    tx.open(bound)                    # blocks until every worker joined (TransferTimeout)
    p = prepare(named, bucket_bytes)  # UpdateWeights(params=p.params, buckets=p.buckets)
    sums = send_stream(tx, p, named)  # hashed as they leave; FinishWeightUpdate(checksums=sums)

Worker side::

    rx = worker_transfer(init.backend)
    rx.join(bound, rank)
    validate(params, buckets)         # before acking UpdateWeights
    got = recv_buckets(rx, params, buckets, sink)
    verify(got, sums)                 # at prepare, with the checksums finish brought
"""

from rlbus.transfer.base import (
    ChecksumMismatch,
    Handle,
    PlanError,
    SharedMemoryTrainer,
    SharedMemoryWorker,
    TrainerTransfer,
    TransferError,
    TransferTimeout,
    UnsupportedDType,
    ViewHandle,
    WorkerTransfer,
)
from rlbus.transfer.buckets import dtype_name, pack, plan, torch_dtype, unpack, validate
from rlbus.transfer.checksum import checksum
from rlbus.transfer.factory import trainer_transfer, worker_transfer
from rlbus.transfer.stream import (
    DEFAULT_BUCKET_BYTES,
    Packed,
    Plan,
    pack_all,
    packs_every_bucket,
    prepare,
    recv_buckets,
    scratch_pair,
    send_all,
    send_stream,
    sole_tensor_bytes,
    verify,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ChecksumMismatch",
    "Handle",
    "Packed",
    "Plan",
    "PlanError",
    "SharedMemoryTrainer",
    "SharedMemoryWorker",
    "TrainerTransfer",
    "TransferError",
    "TransferTimeout",
    "UnsupportedDType",
    "ViewHandle",
    "WorkerTransfer",
    "checksum",
    "dtype_name",
    "pack",
    "pack_all",
    "packs_every_bucket",
    "plan",
    "prepare",
    "recv_buckets",
    "scratch_pair",
    "send_all",
    "send_stream",
    "sole_tensor_bytes",
    "torch_dtype",
    "trainer_transfer",
    "unpack",
    "validate",
    "verify",
    "worker_transfer",
]
