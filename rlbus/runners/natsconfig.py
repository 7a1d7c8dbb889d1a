"""`rlbus nats-config`: a least-privilege nats-server config with one user per role.

Roles and what each may do (P = the subject prefix, default `rl`):

| role | publish | subscribe |
|---|---|---|
| trainer | `P.control.>`, `P.generate`, read-only JetStream API on the state bucket | replies, `P.version`, `P.events.>` |
| controller | worker commands `P.worker.*.*`, `P.controller.hello`, `P.version`, `P.events.>`, JetStream (state KV) | `P.control.>`, worker handshakes, `$SRV.>` |
| worker | its handshake, heartbeat and goodbye (+ replies to its commands), `P.worker.*.status` (the startup check that its id is free) | `P.worker.*.*`, `P.controller.hello`, `P.generate`, `$SRV.>`, its own inbox `_INBOX.P-worker.>` |
| observer | read-only JetStream API on the state bucket | replies, `P.version`, `P.events.>` |

Only trainers publish `P.control.>`; only the controller publishes worker commands and
writes the state KV; everyone may read `P.version`.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import msgspec

from rlbus.schemas import Subjects

ROLES = ("trainer", "controller", "worker", "observer")


class Tls(msgspec.Struct, frozen=True, kw_only=True):
    cert: str
    key: str
    ca: str | None = None
    """Set to require client certificates signed by this CA (mutual TLS)."""


def _kv_read(subjects: Subjects) -> list[str]:
    stream = subjects.kv_stream
    return [
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        "$JS.FC.>",
    ]


def permissions(role: str, subjects: Subjects) -> dict[str, object]:
    """The nats-server `permissions` block for a role."""
    if role == "trainer":
        return {
            "publish": {"allow": [f"{subjects.control_group}.>", subjects.generate, *_kv_read(subjects)]},
            "subscribe": {"allow": ["_INBOX.>", subjects.version, subjects.events]},
        }
    if role == "controller":
        return {
            "publish": {
                "allow": [subjects.worker_commands("*"), subjects.controller_hello, subjects.version, subjects.events,
                          "$JS.API.>", subjects.kv_subjects, subjects.replies_subjects, "_INBOX.>"]
            },
            "subscribe": {
                "allow": [f"{subjects.control_group}.>", subjects.worker_ready, subjects.worker_heartbeat, subjects.worker_gone,
                          "_INBOX.>", "$SRV.>"]
            },
            "allow_responses": True,
        }
    if role == "worker":
        return {
            # + the status subject of a worker id, to check at startup that no live worker holds its id
            "publish": {"allow": [subjects.worker_ready, subjects.worker_heartbeat, subjects.worker_gone,
                                  subjects.worker("*", "status")]},
            "subscribe": {"allow": [subjects.worker_commands("*"), subjects.controller_hello, subjects.generate, "$SRV.>",
                                    f"{subjects.worker_inbox}.>"]},
            "allow_responses": True,  # one reply to each command it receives
        }
    if role == "observer":
        return {
            "publish": {"allow": _kv_read(subjects)},
            "subscribe": {"allow": ["_INBOX.>", subjects.version, subjects.events]},
        }
    raise ValueError(f"unknown role {role!r}; roles are {ROLES}")


def write_config(out: Path, *, prefix: str = "rl", tls: Tls | None = None) -> dict[str, Path]:
    """Write `nats.conf` and one `<role>.env` per role (RLBUS_NATS_USER/PASSWORD), mode 0600.

    Returns {"config": ..., "<role>": env file}. Fresh random passwords every time.
    """
    subjects = Subjects(prefix=prefix)
    out.mkdir(parents=True, exist_ok=True)
    passwords = {r: secrets.token_urlsafe(24) for r in ROLES}
    users = [
        {"user": f"rlbus-{r}", "password": passwords[r], "permissions": permissions(r, subjects)} for r in ROLES
    ]
    # nats-server's config format accepts JSON syntax
    lines = [
        "# written by `rlbus nats-config`: least-privilege users for rlbus roles",
        "authorization " + json.dumps({"users": users}, indent=2),
        # ping every client each second, drop one that misses three: a frozen or partitioned
        # controller's subscriptions go in seconds, not nats-server's default minutes
        'ping_interval: "1s"',
        "ping_max: 3",
    ]
    if tls is not None:
        block: dict[str, object] = {"cert_file": tls.cert, "key_file": tls.key}
        if tls.ca:
            block.update(ca_file=tls.ca, verify=True)
        lines.append("tls " + json.dumps(block, indent=2))
    paths: dict[str, Path] = {"config": out / "nats.conf"}
    _write_private(paths["config"], "\n".join(lines) + "\n")
    for r in ROLES:
        paths[r] = out / f"{r}.env"
        _write_private(paths[r], f"RLBUS_NATS_USER=rlbus-{r}\nRLBUS_NATS_PASSWORD={passwords[r]}\n")
    return paths


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            env[k.strip()] = v.strip()
    return env


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
