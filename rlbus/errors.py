"""One exception type per error code, and the one place that maps codes to them."""

from __future__ import annotations

from rlbus.schemas import ErrorCode, Nack, WorkerFailure


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


class TransportError(RLBusError):
    """A payload did not decode (service error header), not a refusal."""

    code: ErrorCode = "INVALID_ARGUMENT"


_BY_CODE: dict[str, type[RLBusError]] = {
    cls.code: cls
    for cls in (FailedPrecondition, InvalidArgument, DeadlineExceeded, Unavailable, Aborted, Internal, PermissionDenied)
}


def error_for(code: str, message: str, failures: list[WorkerFailure] | None = None) -> RLBusError:
    """The exception for a code (INTERNAL for an unknown one)."""
    return _BY_CODE.get(code, Internal)(message, failures)


def from_nack(nack: Nack) -> RLBusError:
    return error_for(nack.code, nack.message, nack.failures)
