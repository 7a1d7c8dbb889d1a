"""compose.yaml's NATS nodes, as written, with the real nats-server binary: each node's options
are accepted, and the three form one JetStream cluster that holds a 3-replica bucket. Only
what is host-specific is replaced: host names by loopback, ports by free ones, /data by a
temporary folder; a client port is added (compose uses the default, 4222)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import nats
import pytest
import yaml
from nats.js.api import KeyValueConfig, StorageType

from rlbus.runners.children import spawn
from rlbus.runners.natsserver import free_port, server_binary
from tests.integration.test_durability import jetstream_config
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
READY_S = 20.0


class Node:
    """One nats-server child started with `argv`; its log is kept to say why it failed."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = spawn([server_binary(), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if "Server is ready" in line:
                self.ready.set()
        self.ready.set()  # exited: wake the waiter

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _on_loopback(
    argv: list[str], hosts: dict[str, int], own: int, store: Path, configs: dict[str, Path], monitor: int
) -> list[str]:
    """compose's arguments with host names, ports, the store and the mounted configs replaced for this host."""
    out = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "-sd":
            a = str(store)
        elif prev == "-c":
            a = str(configs[a])
        elif prev == "-m":
            a = str(monitor)
        elif prev == "--cluster":
            a = f"nats://127.0.0.1:{own}"
        elif prev == "--routes":
            a = ",".join(f"nats://127.0.0.1:{hosts[u.split('//')[1].split(':')[0]]}" for u in a.split(","))
        out.append(a)
    return out


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    names = [n for n, s in services.items() if str(s.get("image", "")).startswith("nats")]
    routes = {n: free_port("127.0.0.1") for n in names}
    started: list[tuple[Node, int, int]] = []
    try:
        for n in names:
            client, monitor = free_port("127.0.0.1"), free_port("127.0.0.1")
            folder = tmp_path_factory.mktemp(f"{n}-configs")
            configs = {}
            for c in services[n].get("configs", []):  # what compose mounts, written here
                configs[c["target"]] = folder / Path(c["target"]).name
                configs[c["target"]].write_text(compose["configs"][c["source"]]["content"])
            argv = _on_loopback(services[n]["command"], routes, routes[n], tmp_path_factory.mktemp(n), configs, monitor)
            started.append((Node([*argv, "-a", "127.0.0.1", "-p", str(client)]), client, monitor))
        for node, _, _ in started:
            assert node.ready.wait(READY_S) and node.proc.poll() is None, "\n".join(node.log[-20:])
        yield [(f"nats://127.0.0.1:{port}", monitor) for _, port, monitor in started]
    finally:
        for node, _, _ in started:
            node.stop()


async def test_the_compose_nats_nodes_form_one_jetstream_cluster(nodes):
    assert len(nodes) == 3
    nc = await nats.connect([url for url, _ in nodes])
    try:
        js = nc.jetstream()

        async def bucket():
            try:
                return await js.create_key_value(
                    KeyValueConfig(bucket="compose_check", replicas=3, storage=StorageType.FILE)
                )
            except Exception:
                return None

        kv = await eventually(bucket, timeout=30, interval=0.25, what="a 3-replica bucket on the compose cluster")
        await kv.put("k", b"v")
        info = await js.stream_info("KV_compose_check")
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2  # a leader and two followers
    finally:
        await nc.close()


def test_every_compose_nats_node_fsyncs_every_jetstream_write(nodes):
    for url, monitor in nodes:
        assert jetstream_config(monitor)["sync_always"] is True, url
