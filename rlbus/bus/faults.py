"""One map from a NATS outcome to an error code, used by the SDK's calls and by the
controller's fan-out alike.

A request over NATS ends in one of four ways: no one subscribes (no responders), no one
answers in time, the responder's service framework refused the payload (a
`Nats-Service-Error` header: 400 for an undecodable payload or an unknown op), or a reply
arrives, which is a typed Nack or the expected typed reply.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from rlbus.schemas import UNDECODABLE_STATUS, ErrorCode, Nack, RLBusError, WorkerFailure, error_for, reply_decoder
from rlbus.schemas.codec import DecodeError

T = TypeVar("T")

_STATUS_HEADER = "Nats-Service-Error-Code"
_DESCRIPTION_HEADER = "Nats-Service-Error"


class Fault(msgspec.Struct, frozen=True):
    """Why a request got no usable reply: a code callers branch on and a message for people."""

    code: ErrorCode
    message: str
    failures: list[WorkerFailure] = []
    """The workers behind a fleet-wide refusal (a Nack names them)."""

    def error(self) -> RLBusError:
        return error_for(self.code, self.message, self.failures)


def fault_of(e: BaseException, *, who: str, op: str, timeout: float, hint: str = "") -> Fault:
    """The fault for an exception a NATS request raised. `who` names the responder ("the
    controller", "worker w0"); `hint` says how to fix a missing one."""
    if isinstance(e, NoRespondersError):
        return Fault("UNAVAILABLE", f"no responders to {op} ({who} is not running)" + (f"; {hint}" if hint else ""))
    if isinstance(e, MaxPayloadError):
        return Fault("INVALID_ARGUMENT", f"{op} to {who} is larger than the NATS server's max_payload: {e}")
    if isinstance(e, (NatsTimeout, TimeoutError)):
        return Fault("DEADLINE_EXCEEDED", f"no answer to {op} from {who} within {timeout:g}s")
    return Fault("UNAVAILABLE", f"{op} to {who} failed: {type(e).__name__}: {e}")


def service_error(msg: Any, op: str) -> Fault | None:
    """The fault a `Nats-Service-Error` header carries, or None. 400 (the payload did not
    decode, or the op does not exist) is BAD_REQUEST, kept apart from refusals; any other
    status is INTERNAL."""
    headers = msg.headers or {}
    status = headers.get(_STATUS_HEADER)
    if status is None:
        return None
    text = f"{op} rejected: {headers.get(_DESCRIPTION_HEADER, 'service error')} (status {status})"
    return Fault("BAD_REQUEST" if status == UNDECODABLE_STATUS else "INTERNAL", text)


def reply_of(msg: Any, op: str, expect: type[T], decoder: Any = reply_decoder) -> T | Fault:
    """The typed reply a message carries, or the fault that replaces it (a service error, a
    Nack, an undecodable or unexpected reply)."""
    fault = service_error(msg, op)
    if fault is not None:
        return fault
    try:
        reply = decoder.decode(msg.data)
    except DecodeError as e:
        return Fault("INTERNAL", f"undecodable reply to {op}: {e}")
    if isinstance(reply, Nack):
        return Fault(reply.code, reply.message, reply.failures)
    if not isinstance(reply, expect):
        return Fault("INTERNAL", f"{op}: expected {expect.__name__}, got {type(reply).__name__}")
    return reply


def expect_reply(msg: Any, op: str, expect: type[T], decoder: Any = reply_decoder) -> T:
    """The typed reply, or the exception for whatever replaced it."""
    out = reply_of(msg, op, expect, decoder)
    if isinstance(out, Fault):
        raise out.error()
    return out
