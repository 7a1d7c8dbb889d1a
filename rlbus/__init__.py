"""rlbus — keep an LLM inference fleet in step with an RL trainer, over NATS."""

from rlbus.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    RLBusError,
    TransportError,
    Unavailable,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # The clients pull in nats; keep `import rlbus` light for schema-only users.
    if name in ("RLClient", "SyncRLClient"):
        from rlbus import client

        return getattr(client, name)
    raise AttributeError(name)


__all__ = [
    "Aborted",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "PermissionDenied",
    "RLBusError",
    "RLClient",
    "SyncRLClient",
    "TransportError",
    "Unavailable",
]
