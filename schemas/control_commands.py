"""Control commands: trainer -> controller, one op per subject (`rl.control.<op>`).

Each command's tag is its op, so the subject's last token and the payload agree. Only what
a trainer decides is here; what the controller adds for its workers (ranks, session ids,
epochs) lives on the worker commands (worker_commands.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from .base import Message
from .replies import FleetAck, ServerInfo, VersionInfo, WeightCheck
from .state import Backend, PauseMode, SleepTag, UpdateTarget
from .tensors import BucketMeta, ParamMeta, TensorChecksum, TransferInit


class ControlCommand(Message, frozen=True, kw_only=True):
    """Fields every control command carries."""

    reply: ClassVar[type[Message]] = FleetAck
    """What the controller answers (or a Nack)."""

    command_id: str = ""
    """Unique per command (the SDK uses a uuid4); a retry resends the same id and payload and
    gets the first answer; the same id with another op or payload is refused."""
    timeout_s: float | None = None
    """How long the sender waits for the answer. The controller gives up no later (DEADLINE_EXCEEDED)
    and undoes what it started, so its lock is free for the sender's cleanup. None = no bound."""
    trainer_id: str | None = None
    """Who sends it (the SDK: one id per RLClient). The push lease names its holder by it: one
    trainer at a time may update weights; every command of the holder renews its lease. None =
    an anonymous trainer (all anonymous senders count as one)."""


class Pause(ControlCommand, frozen=True, kw_only=True, tag="pause"):
    mode: PauseMode = "abort"
    """abort: in-flight requests end now (status aborted); wait: they finish;
    keep: they freeze and continue on resume. New requests wait for resume in every mode."""


class Resume(ControlCommand, frozen=True, kw_only=True, tag="resume"):
    pass


class IsPaused(ControlCommand, frozen=True, kw_only=True, tag="is_paused"):
    pass


class Sleep(ControlCommand, frozen=True, kw_only=True, tag="sleep"):
    level: Literal[1, 2] = 1
    """1: weights to a host backup, KV cache freed. 2: weights discarded, buffers saved."""
    tags: list[SleepTag] | None = None
    """Parts to put to sleep; None = all."""


class WakeUp(ControlCommand, frozen=True, kw_only=True, tag="wake_up"):
    tags: list[SleepTag] | None = None
    """Parts to wake; None = all."""


class IsSleeping(ControlCommand, frozen=True, kw_only=True, tag="is_sleeping"):
    pass


class GetServerInfo(ControlCommand, frozen=True, kw_only=True, tag="server_info"):
    reply: ClassVar[type[Message]] = ServerInfo


class InitWeightTransfer(ControlCommand, frozen=True, kw_only=True, tag="init_weight_transfer"):
    init_info: TransferInit
    """The rendezvous the trainer opened (rank 0)."""
    backend: Backend | None = None
    """None = the backend every worker reports."""


class StartWeightUpdate(ControlCommand, frozen=True, kw_only=True, tag="start_weight_update"):
    """Open an update session. The one way to start one: target="draft" updates the
    speculative-decoding draft (the SDK's start_draft_weight_update sends this)."""

    target: UpdateTarget = "main"
    base_seq: int | None = None
    """A delta session: the commit sequence (`seq` for main, `draft_seq` for the draft) of the
    weights its deltas apply to. Every worker not holding exactly that commit (another seq,
    dirty, withheld, weights discarded) refuses with FAILED_PRECONDITION naming itself, and
    nothing opens. None = a dense session (no deltas allowed)."""


class UpdateWeights(ControlCommand, frozen=True, kw_only=True, tag="update_weights"):
    params: list[ParamMeta] = []
    buckets: list[BucketMeta] = []
    session_id: str | None = None
    """None = the open session; a named one must be it."""
    group: str = ""
    """The transfer group (TransferInit.group_name) the bytes will be sent on; refused when the
    fleet has joined another one since (another trainer's init). Empty = not checked."""


class FinishWeightUpdate(ControlCommand, frozen=True, kw_only=True, tag="finish_weight_update"):
    weight_version: str | None = None
    """None = commit without changing the version string."""
    session_id: str | None = None
    """None = the open session; a named one must be it."""
    checksums: list[str] = []
    """Every bucket sent in this session, in order: its xxh3-128 (32 hex digits), computed
    by the trainer as the bucket left. The SDK fills it in."""
    tensor_checksums: list[TensorChecksum] = []
    """A delta session: the xxh3-128 of every delta-encoded tensor's full resulting bytes;
    each worker checks what it built against them before it reports ready."""


class AbortWeightUpdate(ControlCommand, frozen=True, kw_only=True, tag="abort_weight_update"):
    session_id: str | None = None
    """None = the open session; a named one must be it."""
    reason: str = ""


class UpdateWeightVersion(ControlCommand, frozen=True, kw_only=True, tag="update_weight_version"):
    new_version: str


class GetWeightVersion(ControlCommand, frozen=True, kw_only=True, tag="get_weight_version"):
    """The version every worker holds (a refusal naming who disagrees otherwise)."""

    reply: ClassVar[type[Message]] = VersionInfo


class VerifyWeights(ControlCommand, frozen=True, kw_only=True, tag="verify_weights"):
    """Every worker hashes the weights it serves (`target`); the controller compares them with
    each other, or with `expected` (the trainer's checksum of every tensor) when given, and
    names every worker that differs. Runs under the fleet's lock: no commit lands mid-check."""

    reply: ClassVar[type[Message]] = WeightCheck

    target: UpdateTarget = "main"
    expected: list[TensorChecksum] = []
    """The trainer's tensors (the xxh3-128 of each one's bytes); empty = compare the replicas."""


AnyControlCommand = Union[
    Pause,
    Resume,
    IsPaused,
    Sleep,
    WakeUp,
    IsSleeping,
    GetServerInfo,
    InitWeightTransfer,
    StartWeightUpdate,
    UpdateWeights,
    FinishWeightUpdate,
    AbortWeightUpdate,
    UpdateWeightVersion,
    GetWeightVersion,
    VerifyWeights,
]
