"""Commands: trainer -> controller on rl.control.<op>, controller -> worker on rl.worker.<id>.<op>.

The tag of each command is its op, so the subject's last token and the payload agree.
"""

from __future__ import annotations

from typing import Literal, Union

from .base import Message
from .state import Backend, PauseMode, SleepTag, UpdateTarget
from .weights import BucketMeta, ParamMeta, TransferInit


class Command(Message, frozen=True, kw_only=True):
    """Fields every command carries."""

    command_id: str = ""
    """Set by the sender; a retried command with the same id runs once."""
    epoch: int = 0
    """The controller epoch that sent a worker command (fencing); 0 from trainers."""


class Pause(Command, frozen=True, kw_only=True, tag="pause"):
    mode: PauseMode = "abort"
    """abort: in-flight requests end now (status aborted); wait: they finish;
    keep: they freeze and continue on resume. New requests wait for resume in every mode."""


class Resume(Command, frozen=True, kw_only=True, tag="resume"):
    pass


class IsPaused(Command, frozen=True, kw_only=True, tag="is_paused"):
    pass


class Sleep(Command, frozen=True, kw_only=True, tag="sleep"):
    level: Literal[1, 2] = 1
    """1: weights to a host backup, KV cache freed. 2: weights discarded, buffers saved."""
    tags: list[SleepTag] | None = None
    """Parts to put to sleep; None = all."""


class WakeUp(Command, frozen=True, kw_only=True, tag="wake_up"):
    tags: list[SleepTag] | None = None
    """Parts to wake; None = all."""


class IsSleeping(Command, frozen=True, kw_only=True, tag="is_sleeping"):
    pass


class GetServerInfo(Command, frozen=True, kw_only=True, tag="server_info"):
    pass


class GetStatus(Command, frozen=True, kw_only=True, tag="status"):
    """controller -> worker: report state (no change)."""


class InitWeightTransfer(Command, frozen=True, kw_only=True, tag="init_weight_transfer"):
    backend: Backend | None = None
    """None = the backend every worker reports."""
    init_info: TransferInit | None = None
    """Trainer -> controller: the rendezvous the trainer opened. Required."""
    rank: int = -1
    """Controller -> worker: this worker's rank in the group."""


class StartWeightUpdate(Command, frozen=True, kw_only=True, tag="start_weight_update"):
    target: UpdateTarget = "main"
    session_id: str = ""
    """Set by the controller."""


class StartDraftWeightUpdate(Command, frozen=True, kw_only=True, tag="start_draft_weight_update"):
    pass


class UpdateWeights(Command, frozen=True, kw_only=True, tag="update_weights"):
    session_id: str = ""
    params: list[ParamMeta] = []
    buckets: list[BucketMeta] = []
    check_only: bool = False
    """Controller -> worker: check names, dtypes and shapes only; start no receive."""


class FinishWeightUpdate(Command, frozen=True, kw_only=True, tag="finish_weight_update"):
    weight_version: str | None = None
    """None = commit without changing the version string."""
    session_id: str = ""
    checksums: list[str] = []
    """Every bucket sent in this session, in order: its xxh3-128 (32 hex digits), computed
    by the trainer as the bucket left. The SDK fills it in."""


class PrepareCommit(Command, frozen=True, kw_only=True, tag="prepare"):
    """controller -> worker, phase 1 of finish: report staged and verified."""

    session_id: str
    checksums: list[str] = []
    """The trainer's checksums (FinishWeightUpdate.checksums) to verify the received buckets against."""


class Commit(Command, frozen=True, kw_only=True, tag="commit"):
    """controller -> worker, phase 2 of finish: apply staged weights, take the version."""

    session_id: str
    weight_version: str | None = None


class AbortWeightUpdate(Command, frozen=True, kw_only=True, tag="abort_weight_update"):
    session_id: str = ""
    reason: str = ""


class UpdateWeightVersion(Command, frozen=True, kw_only=True, tag="update_weight_version"):
    new_version: str


class GetWeightVersion(Command, frozen=True, kw_only=True, tag="get_weight_version"):
    pass


class Sync(Command, frozen=True, kw_only=True, tag="sync"):
    """controller -> worker after its handshake: the committed version. A worker on an older
    one is stale: it takes no rl.generate traffic until it has received current weights."""

    committed_version: str


AnyCommand = Union[
    Pause,
    Resume,
    IsPaused,
    Sleep,
    WakeUp,
    IsSleeping,
    GetServerInfo,
    GetStatus,
    InitWeightTransfer,
    StartWeightUpdate,
    StartDraftWeightUpdate,
    UpdateWeights,
    FinishWeightUpdate,
    PrepareCommit,
    Commit,
    AbortWeightUpdate,
    UpdateWeightVersion,
    GetWeightVersion,
    Sync,
]

# Ops a trainer may send to the controller.
CONTROL_OPS: tuple[str, ...] = (
    "pause",
    "resume",
    "is_paused",
    "sleep",
    "wake_up",
    "is_sleeping",
    "server_info",
    "init_weight_transfer",
    "start_weight_update",
    "start_draft_weight_update",
    "update_weights",
    "finish_weight_update",
    "abort_weight_update",
    "update_weight_version",
    "get_weight_version",
)

# Ops the controller may send to a worker.
WORKER_OPS: tuple[str, ...] = (
    "pause",
    "resume",
    "sleep",
    "wake_up",
    "status",
    "init_weight_transfer",
    "start_weight_update",
    "update_weights",
    "prepare",
    "commit",
    "abort_weight_update",
    "update_weight_version",
    "sync",
)
