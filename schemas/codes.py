"""Error codes shared by every refusal on the wire.

Callers branch on these codes, never on message text.
"""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal[
    "UNAVAILABLE",  # no workers, or a worker is gone, or nothing answers the subject
    "DEADLINE_EXCEEDED",  # a worker (or the controller) did not answer in time
    "PERMISSION_DENIED",  # the NATS server refused this identity the subject (least-privilege config)
    "BAD_REQUEST",  # the payload did not decode, or names no operation (NATS service error 400)
    "INVALID_ARGUMENT",  # the request decoded but is wrong (bad mode, bad version, metadata mismatch)
    "FAILED_PRECONDITION",  # the operation is valid but the fleet is not in a state to run it
    "ABORTED",  # the operation was cancelled (e.g. an update session was aborted)
    "INTERNAL",  # a bug or an unexpected fault; the message says where
]

ERROR_CODES: tuple[ErrorCode, ...] = (
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "PERMISSION_DENIED",
    "BAD_REQUEST",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "ABORTED",
    "INTERNAL",
)
"""Every code, most telling first: when several workers fail one fan-out differently, the
error the caller gets carries the earliest of their codes (a lost worker explains the rest)."""

ERROR_MEANINGS: dict[ErrorCode, str] = {
    "UNAVAILABLE": "no workers, a worker is gone, or nothing answers the subject",
    "DEADLINE_EXCEEDED": "a worker (or the controller) did not answer in time",
    "PERMISSION_DENIED": "the NATS server refused this identity the subject",
    "BAD_REQUEST": "the payload did not decode or names no operation (a NATS service error 400)",
    "INVALID_ARGUMENT": "the request decoded but is wrong (a bad mode, version or metadata)",
    "FAILED_PRECONDITION": "valid, but the fleet is not in a state to run it",
    "ABORTED": "cancelled (e.g. the update session was aborted)",
    "INTERNAL": "a bug or an unexpected fault; the message says where",
}
"""What each code means, for people (the generated protocol reference)."""

# Status code put in the NATS micro `Nats-Service-Error-Code` header when a payload
# does not decode at all (a transport fault, not a refusal).
UNDECODABLE_STATUS = "400"

MAX_COMMAND_BYTES = 8 << 20
"""The largest command payload a service accepts (8 MiB), whatever the NATS server's
max_payload allows: a larger one is answered with a 400 before it is decoded, and changes
nothing. The SDK keeps what it sends under it (update_weights splits its metadata)."""
