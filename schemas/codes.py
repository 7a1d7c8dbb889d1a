"""Error codes shared by every refusal on the wire.

Callers branch on these codes, never on message text.
"""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal[
    "FAILED_PRECONDITION",  # the operation is valid but the fleet is not in a state to run it
    "INVALID_ARGUMENT",  # the request itself is wrong (bad mode, bad version, metadata mismatch)
    "DEADLINE_EXCEEDED",  # a worker did not answer in time
    "UNAVAILABLE",  # no workers, or a worker is gone
    "ABORTED",  # the operation was cancelled (e.g. an update session was aborted)
    "INTERNAL",  # a bug or an unexpected fault; the message says where
    "PERMISSION_DENIED",  # the NATS server refused this identity the subject (least-privilege config)
]

ERROR_CODES: tuple[ErrorCode, ...] = (
    "FAILED_PRECONDITION",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "UNAVAILABLE",
    "ABORTED",
    "INTERNAL",
    "PERMISSION_DENIED",
)

# Status code put in the NATS micro `Nats-Service-Error-Code` header when a payload
# does not decode at all (a transport fault, not a refusal).
UNDECODABLE_STATUS = "400"
