"""Run `rlbus up ...` as a child process and wait for the KEY=value lines it prints when ready."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


@contextmanager
def running_up(
    args: list[str], env: dict[str, str], stderr: Path, keys: tuple[str, ...]
) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """Start `rlbus up <args>`, yield (process, {key: value}) once every key was printed;
    SIGTERM (then SIGKILL) on exit."""
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlbus", "up", *args], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        yield proc, _wait_for(proc, lines, stderr, keys)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for(
    proc: subprocess.Popen[str], lines: queue.Queue[str | None], stderr: Path, keys: tuple[str, ...]
) -> dict[str, str]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    found: dict[str, str] = {}
    while len(found) < len(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(
                f"`rlbus up` printed only {sorted(found)} within {READY_TIMEOUT_S:g}s:\n{stderr.read_text()[-4000:]}"
            )
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line is None:
            proc.wait(5)
            pytest.fail(f"`rlbus up` exited ({proc.returncode}) before it was ready:\n{stderr.read_text()[-4000:]}")
        for k in keys:
            if line.startswith(k):
                found[k] = line.strip().split("=", 1)[1]
    return found


def sigterm_exit_code(proc: subprocess.Popen[str], log: str) -> int:
    """Send SIGTERM and return the exit code; fail if it is still running after STOP_TIMEOUT_S."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`rlbus up` still running {STOP_TIMEOUT_S:g}s after SIGTERM:\n{log}")
