"""Every nats-server config rlbus writes makes JetStream fsync each write before it acknowledges
it (`sync_interval: always`): the embedded server (`rlbus up`, the tests) and `rlbus nats-config`'s
config, as the real binary reports it on its monitoring port (/jsz). compose.yaml's nodes are
tests/integration/test_cluster_compose.py."""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.request
from pathlib import Path

from rlbus.runners.children import spawn
from rlbus.runners.natsconfig import write_config
from rlbus.runners.natsserver import NatsServer, free_port, server_binary

READY_S = 20.0


def jetstream_config(monitor_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/jsz?config=1", timeout=5) as r:
        return json.load(r)["config"]


def test_the_embedded_server_fsyncs_every_jetstream_write(tmp_path: Path):
    monitor = free_port("127.0.0.1")
    extra = tmp_path / "monitor.conf"
    extra.write_text(f"http_port: {monitor}\n")
    with NatsServer(config_file=extra):
        assert jetstream_config(monitor)["sync_always"] is True


def test_the_nats_config_rlbus_writes_fsyncs_every_jetstream_write(tmp_path: Path):
    conf = write_config(tmp_path / "conf")["config"]
    monitor = free_port("127.0.0.1")
    proc = spawn(
        [
            server_binary(),
            "-c",
            str(conf),
            "-js",
            "-sd",
            str(tmp_path / "store"),
            "-a",
            "127.0.0.1",
            "-p",
            str(free_port("127.0.0.1")),
            "-m",
            str(monitor),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, log = threading.Event(), []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line.rstrip())
            if "Server is ready" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(READY_S) and proc.poll() is None, "\n".join(log[-20:])
        assert jetstream_config(monitor)["sync_always"] is True
    finally:
        proc.terminate()
        proc.wait(10)
