"""rlbus.transfer — the out-of-band tensor data plane (torch; never nats).

Trainer side::

    tx = trainer_transfer(init.backend)
    bound = tx.bind(init)             # free port chosen; send `bound` to workers over NATS
    tx.open(bound)                    # blocks until every worker joined (TransferTimeout)
    p = prepare(named, bucket_bytes)
    packed = pack_all(p, named)       # UpdateWeights(params=p.params, buckets=packed.buckets)
    send_packed(tx, packed)

Worker side::

    rx = worker_transfer(init.backend)
    rx.join(bound, rank)
    validate(params, buckets)         # before acking UpdateWeights
    recv_buckets(rx, params, buckets, sink)
"""

from rlbus.transfer.base import (
    ChecksumMismatch,
    Handle,
    PlanError,
    TrainerTransfer,
    TransferError,
    TransferTimeout,
    UnsupportedDType,
    WorkerTransfer,
)
from rlbus.transfer.buckets import dtype_name, pack, plan, torch_dtype, unpack, validate
from rlbus.transfer.checksum import checksum
from rlbus.transfer.factory import trainer_transfer, worker_transfer
from rlbus.transfer.stream import (
    DEFAULT_BUCKET_BYTES,
    Packed,
    Plan,
    alloc_buffers,
    checksums,
    pack_all,
    pack_and_checksum,
    prepare,
    recv_buckets,
    send_all,
    send_buckets,
    send_packed,
    sole_tensor_bytes,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ChecksumMismatch",
    "Handle",
    "Packed",
    "Plan",
    "PlanError",
    "TrainerTransfer",
    "TransferError",
    "TransferTimeout",
    "UnsupportedDType",
    "WorkerTransfer",
    "alloc_buffers",
    "checksum",
    "checksums",
    "dtype_name",
    "pack",
    "pack_all",
    "pack_and_checksum",
    "plan",
    "prepare",
    "recv_buckets",
    "send_all",
    "send_buckets",
    "send_packed",
    "sole_tensor_bytes",
    "torch_dtype",
    "trainer_transfer",
    "unpack",
    "validate",
    "worker_transfer",
]
