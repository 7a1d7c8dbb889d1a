"""rlbus.schemas — the wire contract. Pure msgspec: imports neither torch nor nats."""

from .base import Message
from .codes import ERROR_CODES, UNDECODABLE_STATUS, ErrorCode
from .codec import (
    DecodeError,
    ValidationError,
    command_decoder,
    encode,
    event_decoder,
    generate_reply_decoder,
    generate_request_decoder,
    reply_decoder,
)
from .commands import (
    CONTROL_OPS,
    WORKER_OPS,
    AbortWeightUpdate,
    AnyCommand,
    Command,
    Commit,
    FinishWeightUpdate,
    GetServerInfo,
    GetStatus,
    GetWeightVersion,
    InitWeightTransfer,
    IsPaused,
    IsSleeping,
    Pause,
    PrepareCommit,
    Resume,
    Sleep,
    StartDraftWeightUpdate,
    StartWeightUpdate,
    Sync,
    UpdateWeights,
    UpdateWeightVersion,
    WakeUp,
)
from .events import AnyEvent, ControllerHello, EventKind, FleetEvent, Heartbeat, WorkerGone, WorkerReady
from .generate import FinishReason, GenerateReply, GenerateRequest
from .replies import AnyReply, FleetAck, Nack, ServerInfo, VersionInfo, WorkerAck, WorkerFailure
from .state import (
    DEFAULT_VERSION,
    MAX_VERSION_LEN,
    SLEEP_TAGS,
    Backend,
    Capabilities,
    PauseMode,
    SleepTag,
    UpdateMode,
    UpdateTarget,
    WorkerInfo,
    WorkerState,
    version_problem,
)
from .subjects import Subjects, check_token
from .weights import BucketMeta, DType, ParamMeta, TransferInit, checksums_problem

__all__ = [name for name in dir() if not name.startswith("_")]
