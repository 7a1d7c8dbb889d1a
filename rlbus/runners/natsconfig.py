"""`rlbus nats-config`: a least-privilege nats-server config: one user per role (trainer,
controller, observer) and one per worker id, each allowed only its own subjects and its own
reply inbox. docs/security.md shows the matrix, rendered by `permission_matrix` from the same
`permissions` table the config is written from.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import msgspec

from rlbus.runners.natsserver import SERVER_DURABILITY, SERVER_LIVENESS
from rlbus.schemas import Subjects, check_token

ROLES = ("trainer", "controller", "observer")
"""The shared roles; every worker has an identity of its own (`worker-<id>`)."""

WORKER_SERVICES = 2
"""Micro services a worker hosts on its one connection (`rlbus-worker`, and `rlbus-generate`
while it takes traffic): each answers a discovery request sent to all services."""

WORKER_RESPONSES = 2 * WORKER_SERVICES - 1
"""A worker's `allow_responses` max. nats-server (2.15.1, measured) counts against it every
reply to a request and every delivery of that request to another of the connection's
subscriptions: a `$SRV.PING` to all reaches both services, so 2 deliveries and 2 replies
take 3. A command to the worker takes 1; a generate 2 (where to send it again, then the
answer)."""


class Tls(msgspec.Struct, frozen=True, kw_only=True):
    cert: str
    key: str
    ca: str | None = None
    """Set to require client certificates signed by this CA (mutual TLS)."""


def _kv_read(subjects: Subjects) -> list[str]:
    stream = subjects.kv_stream
    return [
        # reads only: no consumer creation, so a reader cannot name a deliver subject the server
        # would then publish to on its behalf (rl.version, say)
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
    ]


def identities(workers: Sequence[str]) -> list[str]:
    """Every identity a config holds: the three roles, then one per worker id."""
    return [*ROLES, *(f"worker-{check_token(w, 'worker id')}" for w in workers)]


def permissions(identity: str, subjects: Subjects) -> dict[str, object]:
    """The nats-server `permissions` block of one identity: a role, or `worker-<id>` (each
    worker its own: it may speak only under its own id and hear only its own commands).
    Every identity reads replies only under its own inbox prefix (`Subjects.inbox`)."""
    inbox = f"{subjects.inbox(identity)}.>"
    discovery = "$SRV.>"  # $SRV.PING|INFO|STATS: standard NATS tooling finds the services
    if identity == "trainer":
        return {
            "publish": {
                "allow": [
                    f"{subjects.control_group}.>",
                    subjects.generate,
                    subjects.generate_at("*"),  # a generate sent again to the worker that took it
                    *_kv_read(subjects),
                    discovery,
                ]
            },
            "subscribe": {"allow": [inbox, subjects.version, subjects.events]},
        }
    if identity == "controller":
        return {
            "publish": {
                # + answers to trainers and observers, in their inboxes only
                "allow": [
                    subjects.worker_commands("*"),
                    subjects.controller_hello,
                    subjects.version,
                    subjects.events,
                    "$JS.API.>",
                    subjects.kv_subjects,
                    subjects.replies_subjects,
                    f"{subjects.inbox('trainer')}.>",
                    f"{subjects.inbox('observer')}.>",
                ]
            },
            "subscribe": {
                "allow": [
                    f"{subjects.control_group}.>",
                    *(subjects.worker_events(k) for k in ("ready", "heartbeat", "gone")),
                    inbox,
                    "$SRV.>",
                    subjects.version,
                ]
            },
            "allow_responses": True,
        }
    if identity == "observer":
        return {
            "publish": {"allow": [*_kv_read(subjects), discovery]},
            "subscribe": {"allow": [inbox, subjects.version, subjects.events]},
        }
    if identity.startswith("worker-"):
        worker = identity.removeprefix("worker-")
        return {
            # its own events, and its own status subject (the startup check that no live worker holds its id)
            "publish": {"allow": [f"{subjects.prefix}.workers.{worker}.*", subjects.worker(worker, "status")]},
            "subscribe": {
                "allow": [
                    subjects.worker_commands(worker),
                    subjects.controller_hello,
                    subjects.generate,
                    subjects.generate_at(worker),
                    "$SRV.>",
                    inbox,
                    subjects.version,
                ]
            },
            # one reply to each command it receives; one from each micro service it hosts to a
            # discovery request ($SRV.PING|INFO|STATS to all)
            "allow_responses": {"max": WORKER_RESPONSES},
        }
    raise ValueError(f"unknown identity {identity!r}; roles are {ROLES} and worker-<id>")


def permission_matrix(prefix: str = "rl") -> str:
    """The permission table as markdown (identity, publish, subscribe), from `permissions`."""
    subjects = Subjects(prefix=prefix)
    rows = ["| identity | may publish | may subscribe |", "|---|---|---|"]
    for identity in identities(["ID"]):
        p = permissions(identity, subjects)
        pub = ", ".join(f"`{x}`" for x in p["publish"]["allow"])  # type: ignore[index]
        subs = ", ".join(f"`{x}`" for x in p["subscribe"]["allow"])  # type: ignore[index]
        responses = p.get("allow_responses")
        most = responses.get("max", 1) if isinstance(responses, dict) else 1
        replies = (
            ""
            if not responses
            else " (+ one reply to each request it receives)"
            if most == 1
            else f" (+ a reply to each request it receives from each of its {WORKER_SERVICES} micro services)"
        )
        rows.append(f"| {identity} | {pub}{replies} | {subs} |".replace("ID", "<id>"))
    return "\n".join(rows)


def write_config(
    out: Path, *, prefix: str = "rl", tls: Tls | None = None, workers: Sequence[str] = ("worker-0", "worker-1")
) -> dict[str, Path]:
    """Write `nats.conf` and one `<identity>.env` per role and per worker id
    (RLBUS_NATS_USER/PASSWORD/INBOX), mode 0600. Add workers later by writing again with the
    full list (every password is fresh, so restart the server and the services with the new files).

    Returns {"config": ..., "<identity>": env file}.
    """
    subjects = Subjects(prefix=prefix)
    out.mkdir(parents=True, exist_ok=True)
    names = identities(workers)
    passwords = {r: secrets.token_urlsafe(24) for r in names}
    users = [{"user": f"rlbus-{r}", "password": passwords[r], "permissions": permissions(r, subjects)} for r in names]
    # nats-server's config format accepts JSON syntax
    lines = [
        "# written by `rlbus nats-config`: least-privilege users for rlbus roles and workers",
        "authorization " + json.dumps({"users": users}, indent=2),
        # ping every client each second, drop one that misses three: a frozen or partitioned
        # controller's subscriptions go in seconds, not nats-server's default minutes
        SERVER_LIVENESS.rstrip("\n"),
        # JetStream fsyncs every write before acknowledging it: the state store survives an OS
        # crash or power loss (the default syncs every 2 minutes)
        SERVER_DURABILITY.rstrip("\n"),
    ]
    if tls is not None:
        block: dict[str, object] = {"cert_file": tls.cert, "key_file": tls.key}
        if tls.ca:
            block.update(ca_file=tls.ca, verify=True)
        lines.append("tls " + json.dumps(block, indent=2))
    paths: dict[str, Path] = {"config": out / "nats.conf"}
    _write_private(paths["config"], "\n".join(lines) + "\n")
    for r in names:
        paths[r] = out / f"{r}.env"
        _write_private(
            paths[r],
            f"RLBUS_NATS_USER=rlbus-{r}\nRLBUS_NATS_PASSWORD={passwords[r]}\nRLBUS_NATS_INBOX={subjects.inbox(r)}\n",
        )
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
