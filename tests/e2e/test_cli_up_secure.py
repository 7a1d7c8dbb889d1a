"""`rlbus up --secure`: the embedded server runs a least-privilege config, the trainer's env
file drives the CLI, and a worker's credentials cannot command the fleet.

One `up` process for the module; the SIGTERM test stops it, so it is last.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlbus.runners.natsconfig import read_env_file
from tests.e2e.upproc import running_up, sigterm_exit_code


@dataclass
class SecureUp:
    proc: subprocess.Popen[str]
    url: str
    trainer_env: Path
    stderr: Path

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")[-4000:]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_NATS_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _rlbus(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlbus", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[SecureUp]:
    folder = tmp_path_factory.mktemp("up-secure")
    stderr = folder / "up.log"
    args = ["--secure", "--workers", "1", "--config-dir", str(folder / "conf")]
    with running_up(args, _env(), stderr, ("NATS_URL=", "RLBUS_TRAINER_ENV=")) as (proc, found):
        yield SecureUp(proc, found["NATS_URL="], Path(found["RLBUS_TRAINER_ENV="]), stderr)


def test_secure_up_prints_the_url_and_a_private_trainer_env_file(up):
    assert up.url.startswith("nats://127.0.0.1:")
    assert up.trainer_env.is_file()
    assert oct(up.trainer_env.stat().st_mode & 0o777) == oct(0o600)
    assert read_env_file(up.trainer_env)["RLBUS_NATS_USER"] == "rlbus-trainer"


def test_status_with_the_trainer_env_works(up):
    result = _rlbus("status", "--nats-url", up.url, env=_env(**read_env_file(up.trainer_env)))
    assert result.returncode == 0, result.stderr + up.log()
    assert "worker-0" in result.stdout


def test_status_without_credentials_is_refused(up):
    result = _rlbus("status", "--nats-url", up.url, env=_env())
    assert result.returncode != 0
    assert "PERMISSION_DENIED" in result.stderr, result.stderr


def test_pause_with_the_worker_credentials_is_permission_denied(up):
    worker_env = read_env_file(up.trainer_env.parent / "worker-worker-0.env")  # worker-0's own identity
    result = _rlbus("pause", "--nats-url", up.url, env=_env(**worker_env))
    assert result.returncode != 0
    assert "PERMISSION_DENIED" in result.stderr, result.stderr
    status = _rlbus("status", "--nats-url", up.url, env=_env(**read_env_file(up.trainer_env)))
    assert status.returncode == 0, status.stderr
    row = next(line for line in status.stdout.splitlines() if "worker-0" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[0] == "worker-0" and cells[2] == "no", row  # the denied pause changed nothing


@pytest.mark.parametrize("role", ["trainer", "observer"])
def test_discovery_with_a_roles_credentials_is_answered_by_every_service_and_stops_none(up, role):
    import anyio

    from rlbus.bus.connection import NatsAuth, connect, drain
    from tests.integration.test_security import discovery_replies

    env = read_env_file(up.trainer_env.parent / f"{role}.env")
    auth = NatsAuth(user=env["RLBUS_NATS_USER"], password=env["RLBUS_NATS_PASSWORD"], inbox=env["RLBUS_NATS_INBOX"])

    async def discover() -> list[list[dict]]:
        nc = await connect(up.url, name=f"discovery-{role}", auth=auth)
        try:  # what `nats micro ls` and `nats micro stats` send: one request to every service
            return [await discovery_replies(nc, f"$SRV.{verb}", want=3) for verb in ("PING", "INFO", "STATS")]
        finally:
            await drain(nc)

    for replies in anyio.run(discover):
        assert sorted(r["name"] for r in replies) == ["rlbus-controller", "rlbus-generate", "rlbus-worker"], replies
    status = _rlbus("status", "--nats-url", up.url, env=_env(**read_env_file(up.trainer_env)))
    assert status.returncode == 0 and "worker-0" in status.stdout, status.stderr + up.log()
    assert up.proc.poll() is None, up.log()
    assert "Stopping" not in up.log() and "exited" not in up.log().lower(), up.log()


def test_sigterm_stops_secure_up_with_exit_0(up):
    # keep last: this stops the module's fleet
    assert up.proc.poll() is None, up.log()
    code = sigterm_exit_code(up.proc, up.log())
    assert code == 0, up.log()
