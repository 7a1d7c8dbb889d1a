"""A non-Python client: the official NATS JavaScript client drives the fleet from the protocol
reference alone (examples/js/drive.mjs). Skipped only where Node is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from tests.fleet import fleet_running

JS = Path(__file__).resolve().parents[2] / "examples" / "js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed on this machine")


def _install() -> None:
    if not (JS / "node_modules" / "nats").is_dir():
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=JS, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"npm ci failed (the npm registry must be reachable):\n{done.stderr[-3000:]}"


async def test_the_javascript_client_drives_the_fleet(nats_server, prefix):
    await anyio.to_thread.run_sync(_install)
    async with fleet_running(nats_server.url, prefix, ("w0", "w1")) as (f, rl):
        env = dict(os.environ, NATS_URL=nats_server.url, RLBUS_PREFIX=prefix)
        done = await anyio.run_process([NODE, "drive.mjs"], cwd=JS, env=env, check=False)
        out, err = done.stdout.decode(), done.stderr.decode()
        assert done.returncode == 0, f"{out}\n{err[-3000:]}"
        assert "discovered rlbus-controller" in out and "workers 2" in out
        assert "paused true" in out and "is_paused true" in out and "is_paused false" in out
        assert "published js-" in out and "generated 4 tokens with js-" in out
        assert "refused INVALID_ARGUMENT" in out
        version = await rl.get_weight_version_info()
        assert version.version.startswith("js-") and f"seq {version.seq}" in out
        assert not await rl.is_paused()
