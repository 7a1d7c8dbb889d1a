"""`rlbus demo` as a user runs it: a short run as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus", "demo", "--steps", "10", "--out", str(out), "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=360,
    )
    return proc, out


def test_demo_exits_cleanly_and_writes_its_log_and_plot(demo_run):
    proc, out = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "log.json").is_file()
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reward" in proc.stderr and "wrote" in proc.stderr


def test_demo_commits_every_step_version_in_order(demo_run):
    _, out = demo_run
    log = json.loads((out / "log.json").read_text())
    assert [s["version"] for s in log["steps"]] == [f"step-{i}" for i in range(1, 11)]
    assert all(s["bytes_pushed"] > 0 and s["sync_s"] > 0 for s in log["steps"])


def test_demo_reward_rises(demo_run):
    _, out = demo_run
    rewards = [s["reward"] for s in json.loads((out / "log.json").read_text())["steps"]]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, rewards


def test_demo_measures_draft_acceptance(demo_run):
    _, out = demo_run
    steps = json.loads((out / "log.json").read_text())["steps"]
    assert all(s["acceptance"] is not None for s in steps)
    assert steps[-1]["draft_version"] == "draft-8"
