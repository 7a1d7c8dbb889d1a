"""`rlbus up`: the embedded nats-server plus controller and workers as child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import anyio

from rlbus.bus.connection import NatsAuth
from rlbus.runners.children import spawn
from rlbus.runners.natsserver import NatsCluster, NatsServer
from rlbus.schemas.errors import DeadlineExceeded
from rlbus.sdk.client import RLClient


class ProcessFleet:
    """Child processes of one fleet; stop() always reaps them (SIGTERM -> wait -> SIGKILL)."""

    def __init__(
        self,
        url: str,
        workers: int,
        worker_args: Sequence[str] = (),
        controller_args: Sequence[str] = (),
        log_level: str | None = None,
        role_env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.role_env = role_env or {}
        """Extra environment per role ("controller", "worker", "trainer"): credentials."""
        self.log_level = log_level
        self.url = url
        self.n_workers = workers
        self.worker_args = list(worker_args)
        self.controller_args = list(controller_args)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str]) -> None:
        # credentials: the process's own identity (worker-<id>), else its role's
        own = self.role_env.get(name if args[0] != "worker" else f"worker-{name}", self.role_env.get(args[0], {}))
        env = dict(os.environ, RLBUS_NATS_URL=self.url, PYTHONUNBUFFERED="1", **own)
        if self.log_level:
            env["RLBUS_LOG_LEVEL"] = self.log_level
        self.procs[name] = spawn([sys.executable, "-m", "rlbus", *args], env=env)

    def start(self) -> None:
        self._spawn("controller", ["controller", "--nats-url", self.url, *self.controller_args])
        for i in range(self.n_workers):
            self._spawn(f"worker-{i}", ["worker", "--nats-url", self.url, "--id", f"worker-{i}", *self.worker_args])

    async def wait_ready(self, timeout: float = 120.0) -> RLClient:
        """Wait until every worker is registered with the controller; returns a connected client."""
        trainer = self.role_env.get("trainer", {})
        auth = (
            NatsAuth(
                user=trainer.get("RLBUS_NATS_USER"),
                password=trainer.get("RLBUS_NATS_PASSWORD"),
                inbox=trainer.get("RLBUS_NATS_INBOX"),
            )
            if trainer
            else None
        )
        rl = await RLClient.connect(self.url, timeout=5.0, auth=auth)
        joined = await rl.nc.subscribe(rl.subjects.event("worker_joined"))
        try:
            with anyio.fail_after(timeout):
                while True:
                    self.check_alive()
                    try:
                        info = await rl.server_info()
                        if len(info.workers) >= self.n_workers:
                            return rl
                    except DeadlineExceeded:
                        pass
                    except Exception:
                        pass  # controller not up yet
                    with anyio.move_on_after(1.0):  # a join event wakes us at once
                        await joined.next_msg(timeout=None)  # type: ignore[arg-type]
        except BaseException:
            await rl.close()
            raise
        finally:
            try:
                await joined.unsubscribe()
            except Exception:
                pass

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"fleet processes exited: {dead}")

    def stop(self, timeout: float = 15.0) -> None:
        # workers first so they can still say goodbye to the controller
        order = [n for n in self.procs if n != "controller"] + [n for n in self.procs if n == "controller"]
        for n in order:
            p = self.procs[n]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for n in order:
            p = self.procs[n]
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


def embedded_or(
    url: str | None, config_file: str | os.PathLike[str] | None = None, cluster: int = 1
) -> tuple[str, NatsServer | NatsCluster | None]:
    """The given URL, or a freshly started embedded server's (or cluster's: every node's URL)."""
    if url:
        return url, None
    if cluster > 1:
        if config_file is not None:
            raise ValueError("an embedded cluster runs without a config file (no --secure)")
        nodes = NatsCluster(cluster).start()
        return nodes.url, nodes
    server = NatsServer(config_file=str(config_file) if config_file is not None else None).start()
    return server.url, server
