"""Worker commands: controller -> one worker on `rl.worker.<id>.<op>`.

Every worker command carries the epoch of the controller that sent it (fencing) and a
command id of its fan-out (a redelivered command runs once). Each tag is its op.
"""

from __future__ import annotations

from typing import Literal, Union

from .base import Message
from .state import FleetState, PauseMode, SleepTag, UpdateTarget
from .tensors import BucketMeta, ParamMeta, TensorChecksum, TransferInit


class WorkerCommand(Message, frozen=True, kw_only=True):
    """Fields every worker command carries."""

    epoch: int
    """The epoch of the controller that sent it; a worker refuses an older one."""
    command_id: str
    """One per fan-out; a retried command with the same id runs once."""


class PauseWorker(WorkerCommand, frozen=True, kw_only=True, tag="pause"):
    mode: PauseMode


class ResumeWorker(WorkerCommand, frozen=True, kw_only=True, tag="resume"):
    pass


class SleepWorker(WorkerCommand, frozen=True, kw_only=True, tag="sleep"):
    level: Literal[1, 2]
    tags: list[SleepTag] | None = None
    """None = all."""


class WakeUpWorker(WorkerCommand, frozen=True, kw_only=True, tag="wake_up"):
    tags: list[SleepTag] | None = None
    """None = all."""


class StatusWorker(WorkerCommand, frozen=True, kw_only=True, tag="status"):
    """Report state (no change)."""


class InitWeightTransferWorker(WorkerCommand, frozen=True, kw_only=True, tag="init_weight_transfer"):
    init_info: TransferInit
    """The trainer's rendezvous."""
    rank: int
    """This worker's rank in the group."""


class StartWeightUpdateWorker(WorkerCommand, frozen=True, kw_only=True, tag="start_weight_update"):
    session_id: str
    target: UpdateTarget
    base_seq: int | None = None
    """A delta session's base (StartWeightUpdate.base_seq): refused unless the worker holds exactly it."""
    repair: bool = False
    """A repair from a peer (no trainer session): a worker that is withheld (behind, serving
    nothing) lands the bytes in its live weights whatever its update mode, and hashes every
    tensor as it lands; prepare checks those against the manifest (the bucket checksums are
    not needed), and it serves only after the commit."""


class UpdateWeightsWorker(WorkerCommand, frozen=True, kw_only=True, tag="update_weights"):
    session_id: str
    params: list[ParamMeta]
    buckets: list[BucketMeta]
    check_only: bool = False
    """Check names, dtypes and shapes only; start no receive."""


class PrepareWorker(WorkerCommand, frozen=True, kw_only=True, tag="prepare"):
    """Phase 1 of finish: report staged and verified."""

    session_id: str
    checksums: list[str] = []
    """The trainer's checksums (FinishWeightUpdate.checksums) to verify the received buckets against."""
    tensor_checksums: list[TensorChecksum] = []
    """FinishWeightUpdate.tensor_checksums: the full resulting tensors of a delta session."""


class CommitWorker(WorkerCommand, frozen=True, kw_only=True, tag="commit"):
    """Phase 2 of finish: apply staged weights, take the version."""

    session_id: str
    weight_version: str | None = None
    """None = keep the version string."""
    seq: int = 0
    """The commit sequence the committed weights take (of the main or the draft model)."""


class AbortWeightUpdateWorker(WorkerCommand, frozen=True, kw_only=True, tag="abort_weight_update"):
    session_id: str | None = None
    """The session to drop; None = whichever is open."""
    reason: str = ""


class UpdateWeightVersionWorker(WorkerCommand, frozen=True, kw_only=True, tag="update_weight_version"):
    new_version: str
    seq: int = 0
    """The commit sequence the version takes."""


class SyncWorker(WorkerCommand, frozen=True, kw_only=True, tag="sync"):
    """After the worker's handshake: the committed version. A worker on an older one is
    stale: it takes no rl.generate traffic until it has received current weights."""

    committed_version: str
    seq: int = 0
    """Its commit sequence: a worker that holds the committed version takes it."""
    desired: FleetState = FleetState()
    """The fleet's desired state: the worker pauses, sleeps, resumes or wakes to match it
    before it takes generation traffic."""
    controller_id: str = ""
    """The controller syncing it."""
    liveness_s: float = 3.0
    """The controller drops a worker silent this long: a worker that finds it was silent
    longer stops serving until the controller has reconciled it again."""


class OfferWeightsWorker(WorkerCommand, frozen=True, kw_only=True, tag="offer_weights"):
    """Repair, on the healthy peer: host rank 0 of a new transfer group (`init_info`, port 0 =
    a free one; the peer fills in its own address) and plan its committed `target` weights as
    buckets. The ack's `offer` carries the bound group and the plan; nothing is sent yet."""

    target: UpdateTarget = "main"
    init_info: TransferInit


class SendWeightsWorker(WorkerCommand, frozen=True, kw_only=True, tag="send_weights"):
    """Repair, on the peer: once every receiver joined the offered group, send buckets of the
    plan (the committed bits, read while it keeps serving); the ack's `sent_checksums` are
    their checksums, in order. The group stays until leave_weight_transfer."""

    group_name: str
    first: int = 0
    last: int | None = None
    """Buckets first..last-1 of the plan (None: to the end); the receivers posted their receive first."""
    checksums: bool = True
    """Hash every bucket sent (`sent_checksums`); False: send only, the receivers verify every
    tensor against the commit's manifest (a repair)."""


class LeaveWeightTransferWorker(WorkerCommand, frozen=True, kw_only=True, tag="leave_weight_transfer"):
    """Leave transfer group `group_name` (a repair's), if this worker is in it or hosts it; the
    trainer's next push builds a group with it again."""

    group_name: str


class HashWeightsWorker(WorkerCommand, frozen=True, kw_only=True, tag="hash_weights"):
    """Hash every tensor the worker serves (`target`); the ack carries the checksums."""

    target: UpdateTarget = "main"


AnyWorkerCommand = Union[
    PauseWorker,
    ResumeWorker,
    SleepWorker,
    WakeUpWorker,
    StatusWorker,
    InitWeightTransferWorker,
    StartWeightUpdateWorker,
    UpdateWeightsWorker,
    PrepareWorker,
    CommitWorker,
    AbortWeightUpdateWorker,
    UpdateWeightVersionWorker,
    SyncWorker,
    HashWeightsWorker,
    OfferWeightsWorker,
    SendWeightsWorker,
    LeaveWeightTransferWorker,
]
