"""rlbus — keep an LLM inference fleet in step with an RL trainer, over NATS.

The trainer SDK: `RLClient` (async), `SyncRLClient` (blocking) and one exception type per
error code. The SDK lives in rlbus.sdk, the NATS plumbing in rlbus.bus, the data plane in
rlbus.transfer; rlbus.runners starts processes (CLI, embedded nats-server, demo).
"""

from rlbus.schemas.errors import (
    Aborted,
    BadRequest,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    RLBusError,
    Unavailable,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # The clients pull in nats; keep `import rlbus` light for schema-only users.
    if name in ("RLClient", "SyncRLClient"):
        from rlbus.sdk import client

        return getattr(client, name)
    raise AttributeError(name)


__all__ = [
    "Aborted",
    "BadRequest",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "PermissionDenied",
    "RLBusError",
    "RLClient",
    "SyncRLClient",
    "Unavailable",
]
