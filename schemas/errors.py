"""One exception type per error code, and the one place that maps codes to them.

Here, in the leaf, so the SDK and the services raise the same types without importing each other."""

from __future__ import annotations

from .codes import ErrorCode
from .replies import Nack, WorkerFailure


class RLBusError(Exception):
    """Base of every refusal rlbus raises. ``code`` is what callers branch on."""

    code: ErrorCode = "INTERNAL"

    def __init__(self, message: str, failures: list[WorkerFailure] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.failures: list[WorkerFailure] = list(failures or [])

    @property
    def workers(self) -> list[str]:
        """Ids of the workers that caused the error, if any."""
        return [f.worker_id for f in self.failures]

    def to_nack(self) -> Nack:
        return Nack(code=self.code, message=self.message, failures=self.failures)


class FailedPrecondition(RLBusError):
    code: ErrorCode = "FAILED_PRECONDITION"


class InvalidArgument(RLBusError):
    code: ErrorCode = "INVALID_ARGUMENT"


class DeadlineExceeded(RLBusError):
    code: ErrorCode = "DEADLINE_EXCEEDED"


class Unavailable(RLBusError):
    code: ErrorCode = "UNAVAILABLE"


class Aborted(RLBusError):
    code: ErrorCode = "ABORTED"


class Internal(RLBusError):
    code: ErrorCode = "INTERNAL"


class PermissionDenied(RLBusError):
    """The NATS server refused this identity a subject (see `rlbus nats-config`)."""

    code: ErrorCode = "PERMISSION_DENIED"


class BadRequest(RLBusError):
    """The payload did not decode or named no operation (a NATS service error 400): a
    transport fault from a client that speaks another contract, not a refusal."""

    code: ErrorCode = "BAD_REQUEST"


_BY_CODE: dict[str, type[RLBusError]] = {
    cls.code: cls
    for cls in (
        FailedPrecondition,
        InvalidArgument,
        DeadlineExceeded,
        Unavailable,
        Aborted,
        Internal,
        PermissionDenied,
        BadRequest,
    )
}


def refuse(message: str, why: dict[str, str], code: ErrorCode = "FAILED_PRECONDITION") -> RLBusError:
    """A refusal that concerns workers: `why` maps each worker id to its reason, carried in
    `failures` (structured, for callers) as well as in the message (for people)."""
    failures = [WorkerFailure(worker_id=w, code=code, message=m) for w, m in sorted(why.items())]
    return error_for(code, message, failures)


def error_for(code: str, message: str, failures: list[WorkerFailure] | None = None) -> RLBusError:
    """The exception for a code (INTERNAL for an unknown one)."""
    return _BY_CODE.get(code, Internal)(message, failures)


def from_nack(nack: Nack) -> RLBusError:
    return error_for(nack.code, nack.message, nack.failures)
