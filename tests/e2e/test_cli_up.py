"""`rlbus up` as a real process tree: embedded nats-server, a controller and two workers.

One `up` per module (every child imports torch, ~3 s each). The SIGTERM test stops it,
so it is the last test of the module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlbus.sdk.client import RLClient
from tests.e2e.upproc import running_up, sigterm_exit_code

WORKERS = ["worker-0", "worker-1"]


@dataclass
class Up:
    proc: subprocess.Popen[str]
    url: str
    children: dict[int, str]
    """pid -> command line of every child `up` started (controller, workers, nats-server)."""
    stderr: Path

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")[-4000:]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RLBUS_NATS_URL", None)  # `up` must start its own embedded server
    return env


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid`, read from /proc."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie has exited; it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _rlbus(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlbus", *args], capture_output=True, text=True, timeout=timeout, env=_env()
    )


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[Up]:
    stderr = tmp_path_factory.mktemp("up") / "up.log"
    with running_up(["--workers", "2"], _env(), stderr, ("NATS_URL=",)) as (proc, found):
        yield Up(proc, found["NATS_URL="], _children(proc.pid), stderr)


async def test_up_prints_the_url_once_every_worker_is_registered(up):
    assert up.url.startswith("nats://127.0.0.1:")
    async with await RLClient.connect(up.url, timeout=10.0) as rl:
        info = await rl.server_info()
    assert [w.worker_id for w in info.workers] == WORKERS
    assert info.capabilities.weight_transfer_backend == "gloo"  # `up`'s default reaches the workers
    assert info.capabilities.sleep_mode_enabled


def test_a_normal_start_prints_only_what_a_user_needs(up):
    log = up.stderr.read_text(errors="replace")
    start = log.split("Ctrl-C to stop.", 1)[0]  # what `up` said until it was ready
    assert "rlbus up: NATS on " in start and "rlbus up: controller + 2 workers on" in log, log[-2000:]
    noisy = [line for line in start.splitlines() if " INFO " in line or "retrying" in line or "disconnected" in line]
    assert not noisy, noisy


def test_up_runs_the_server_the_controller_and_each_worker_as_children(up):
    commands = list(up.children.values())
    assert len(up.children) == 4, commands
    assert sum("nats-server" in c for c in commands) == 1
    assert sum(" controller " in f" {c} " for c in commands) == 1
    assert all(sum(f"--id {w}" in c for c in commands) == 1 for w in WORKERS)


def test_status_command_lists_both_workers(up):
    result = _rlbus("status", "--nats-url", up.url)
    assert result.returncode == 0, result.stderr
    assert all(w in result.stdout for w in WORKERS), result.stdout
    assert "backend=gloo" in result.stdout


async def test_client_pauses_resumes_and_generates_against_up(up):
    async with await RLClient.connect(up.url, timeout=20.0) as rl:
        paused = await rl.pause(mode="wait")
        assert [w.worker_id for w in paused.workers] == WORKERS
        assert all(w.paused and w.pause_mode == "wait" for w in paused.workers)
        assert await rl.is_paused()

        resumed = await rl.resume()
        assert not any(w.paused for w in resumed.workers)
        assert not await rl.is_paused()

        reply = await rl.generate([1, 2, 3], 8)
        assert reply.finish_reason == "length" and len(reply.tokens) == 8 and reply.worker_id in WORKERS


async def test_pause_and_resume_commands_change_the_fleet_state(up):
    paused = _rlbus("pause", "--mode", "keep", "--nats-url", up.url)
    assert paused.returncode == 0, paused.stderr
    assert all(f"{w}: paused=True(keep)" in paused.stdout for w in WORKERS), paused.stdout
    async with await RLClient.connect(up.url, timeout=10.0) as rl:
        assert await rl.is_paused()
        held = _rlbus("status", "--nats-url", up.url)
        assert "fleet paused (keep)" in held.stdout, held.stdout  # a pause nobody releases is visible

        resumed = _rlbus("resume", "--nats-url", up.url)
        assert resumed.returncode == 0, resumed.stderr
        assert all(f"{w}: paused=False" in resumed.stdout for w in WORKERS), resumed.stdout
        assert not await rl.is_paused()
        assert "fleet paused" not in _rlbus("status", "--nats-url", up.url).stdout


def test_version_command_shows_and_sets_the_fleet_version(up):
    shown = _rlbus("version", "--nats-url", up.url)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "default"
    changed = _rlbus("version", "--nats-url", up.url, "--set", "v-from-cli")
    assert changed.returncode == 0 and changed.stdout.strip() == "v-from-cli", changed.stderr
    refused = _rlbus("version", "--nats-url", up.url, "--set", "bad\tversion")
    assert refused.returncode != 0 and "INVALID_ARGUMENT" in refused.stderr
    assert "v-from-cli" in _rlbus("status", "--nats-url", up.url).stdout


def test_a_second_worker_with_a_live_id_exits_nonzero_naming_the_id(up):
    second = _rlbus("worker", "--id", WORKERS[0], "--nats-url", up.url)
    assert second.returncode == 1, second.stderr[-2000:]
    assert f"worker id '{WORKERS[0]}' is already in use" in second.stderr
    assert "Traceback" not in second.stderr
    shown = _rlbus("status", "--nats-url", up.url)
    assert shown.returncode == 0 and all(w in shown.stdout for w in WORKERS)


def test_a_command_with_no_controller_exits_nonzero_naming_unavailable(nats_server):
    # the session's server runs no controller under the default prefix
    result = _rlbus("status", "--nats-url", nats_server.url)
    assert result.returncode != 0
    assert "UNAVAILABLE" in result.stderr


def test_sigterm_stops_up_and_every_child_and_exits_0(up):
    # keep last: this stops the module's fleet
    assert up.proc.poll() is None, up.log()
    assert all(_alive(pid) for pid in up.children), up.children

    code = sigterm_exit_code(up.proc, up.log())
    assert code == 0, up.log()
    left = {pid: cmd for pid, cmd in up.children.items() if _alive(pid)}
    assert not left, f"children left running: {left}"
    assert "rlbus up: stopped" in up.log()


def test_up_with_an_embedded_three_node_cluster_serves_on_every_node(tmp_path):
    with running_up(["--nats-cluster", "3", "-n", "1"], _env(), tmp_path / "up.log", ("NATS_URL=",)) as (proc, found):
        urls = found["NATS_URL="].split(",")
        assert len(urls) == 3
        for url in urls:  # any single node reaches the whole fleet
            shown = _rlbus("status", "--nats-url", url)
            assert shown.returncode == 0 and "worker-0" in shown.stdout, shown.stderr
