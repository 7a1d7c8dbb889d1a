"""rlbus.schemas — the wire contract and the typed errors. Pure msgspec: imports neither torch nor nats."""

from .base import Message, op_of, ops_of
from .codec import (
    DecodeError,
    ValidationError,
    encode,
    event_decoder,
    generate_reply_decoder,
    generate_request_decoder,
    reply_decoder,
    version_decoder,
)
from .codes import ERROR_CODES, MAX_COMMAND_BYTES, UNDECODABLE_STATUS, ErrorCode
from .control_commands import (
    AbortWeightUpdate,
    AnyControlCommand,
    ControlCommand,
    FinishWeightUpdate,
    GetServerInfo,
    GetWeightVersion,
    InitWeightTransfer,
    IsPaused,
    IsSleeping,
    Pause,
    Resume,
    Sleep,
    StartWeightUpdate,
    UpdateWeights,
    UpdateWeightVersion,
    VerifyWeights,
    WakeUp,
)
from .errors import (
    Aborted,
    BadRequest,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    RLBusError,
    Unavailable,
    error_for,
    from_nack,
    refuse,
)
from .events import AnyEvent, ControllerHello, EventKind, FleetEvent, Heartbeat, WorkerGone, WorkerReady
from .generate import FinishReason, GenerateReply, GenerateRequest, WeightVersionSpan
from .replies import (
    AnyReply,
    CommitDecision,
    FleetAck,
    Nack,
    PushLease,
    RepairOffer,
    ServerInfo,
    VersionInfo,
    WeightCheck,
    WorkerAck,
    WorkerFailure,
    WorkerWeights,
)
from .state import (
    DEFAULT_VERSION,
    MAX_VERSION_LEN,
    SLEEP_TAGS,
    Backend,
    Capabilities,
    FleetState,
    PauseMode,
    SleepTag,
    UpdateMode,
    UpdateTarget,
    WorkerInfo,
    WorkerState,
    version_problem,
)
from .subjects import (
    FIRST_SEND_HEADER,
    HANDED_BACK_HEADER,
    RESEND_TO_HEADER,
    SENDS_AGAIN_HEADER,
    UNKNOWN_OP_QUEUE,
    KvKey,
    ServiceName,
    Subjects,
    check_token,
)
from .tensors import (
    BucketMeta,
    DeltaIndex,
    DType,
    Encoding,
    ParamMeta,
    TensorChecksum,
    TransferInit,
    checksums_problem,
    tensor_checksums_problem,
)
from .worker_commands import (
    AbortWeightUpdateWorker,
    AnyWorkerCommand,
    CommitWorker,
    HashWeightsWorker,
    InitWeightTransferWorker,
    LeaveWeightTransferWorker,
    OfferWeightsWorker,
    PauseWorker,
    PrepareWorker,
    ResumeWorker,
    SendWeightsWorker,
    SleepWorker,
    StartWeightUpdateWorker,
    StatusWorker,
    SyncWorker,
    UpdateWeightsWorker,
    UpdateWeightVersionWorker,
    WakeUpWorker,
    WorkerCommand,
)

CONTROL_OPS: tuple[str, ...] = ops_of(AnyControlCommand)
"""Ops a trainer may send to the controller (derived from the union, so they cannot drift)."""
WORKER_OPS: tuple[str, ...] = ops_of(AnyWorkerCommand)
"""Ops the controller may send to a worker."""

__all__ = [name for name in dir() if not name.startswith("_")]
