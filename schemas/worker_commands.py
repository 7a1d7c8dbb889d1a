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


class WakeWorker(WorkerCommand, frozen=True, kw_only=True, tag="wake_up"):
    tags: list[SleepTag] | None = None
    """None = all."""


class GetStatus(WorkerCommand, frozen=True, kw_only=True, tag="status"):
    """Report state (no change)."""


class JoinTransfer(WorkerCommand, frozen=True, kw_only=True, tag="init_weight_transfer"):
    init_info: TransferInit
    """The trainer's rendezvous."""
    rank: int
    """This worker's rank in the group."""


class OpenSession(WorkerCommand, frozen=True, kw_only=True, tag="start_weight_update"):
    session_id: str
    target: UpdateTarget
    base_seq: int | None = None
    """A delta session's base (StartWeightUpdate.base_seq): refused unless the worker holds exactly it."""


class ReceiveWeights(WorkerCommand, frozen=True, kw_only=True, tag="update_weights"):
    session_id: str
    params: list[ParamMeta]
    buckets: list[BucketMeta]
    check_only: bool = False
    """Check names, dtypes and shapes only; start no receive."""


class PrepareCommit(WorkerCommand, frozen=True, kw_only=True, tag="prepare"):
    """Phase 1 of finish: report staged and verified."""

    session_id: str
    checksums: list[str] = []
    """The trainer's checksums (FinishWeightUpdate.checksums) to verify the received buckets against."""
    tensor_checksums: list[TensorChecksum] = []
    """FinishWeightUpdate.tensor_checksums: the full resulting tensors of a delta session."""


class Commit(WorkerCommand, frozen=True, kw_only=True, tag="commit"):
    """Phase 2 of finish: apply staged weights, take the version."""

    session_id: str
    weight_version: str | None = None
    """None = keep the version string."""
    seq: int = 0
    """The commit sequence the committed weights take (of the main or the draft model)."""


class AbortSession(WorkerCommand, frozen=True, kw_only=True, tag="abort_weight_update"):
    session_id: str | None = None
    """The session to drop; None = whichever is open."""
    reason: str = ""


class SetVersion(WorkerCommand, frozen=True, kw_only=True, tag="update_weight_version"):
    new_version: str
    seq: int = 0
    """The commit sequence the version takes."""


class Sync(WorkerCommand, frozen=True, kw_only=True, tag="sync"):
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


AnyWorkerCommand = Union[
    PauseWorker,
    ResumeWorker,
    SleepWorker,
    WakeWorker,
    GetStatus,
    JoinTransfer,
    OpenSession,
    ReceiveWeights,
    PrepareCommit,
    Commit,
    AbortSession,
    SetVersion,
    Sync,
]
