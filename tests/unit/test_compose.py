"""compose.yaml parses, describes a 3-node NATS cluster with JetStream, a leading and a standby
controller, workers and the trainer, and runs only commands and options the CLI has. (That the
nats-server options are real, and form a cluster, is tests/integration/test_cluster_compose.py.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import yaml

from rlbus.runners.cli import main
from rlbus.runners.natsserver import server_binary

ROOT = Path(__file__).resolve().parents[2]
NODES = ("nats-0", "nats-1", "nats-2")


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _rlbus_services(services: dict) -> dict:
    return {name: s for name, s in services.items() if "build" in s}


def test_compose_has_a_three_node_jetstream_cluster():
    services = _compose()["services"]
    assert set(NODES) <= set(services)
    names = set()
    for node in NODES:
        argv = services[node]["command"]
        assert "-js" in argv and _flag(argv, "-sd") == "/data", node
        assert any(v.endswith(":/data") for v in services[node]["volumes"]), f"{node}: its store is a volume of its own"
        assert _flag(argv, "--cluster_name") == "rlbus"
        assert _flag(argv, "--cluster").endswith(":6222")
        assert sorted(_flag(argv, "--routes").split(",")) == [f"nats://{n}:6222" for n in NODES], (
            f"{node}: routes to every node"
        )
        names.add(_flag(argv, "--name"))
    assert names == set(NODES), "every node has a name of its own"


def test_compose_has_a_leader_and_a_standby_controller_workers_and_a_trainer():
    services = _compose()["services"]
    controllers = [n for n, s in _rlbus_services(services).items() if s["command"][0] == "controller"]
    assert len(controllers) == 2, "a leader and a standby"
    assert services["worker"]["command"][0] == "worker" and services["worker"]["deploy"]["replicas"] == 2
    assert services["trainer"]["command"][0] == "demo"
    assert services["trainer"]["environment"]["RLBUS_MASTER_ADDR"] == services["trainer"]["hostname"]


def test_every_rlbus_service_reaches_every_nats_node():
    every = sorted(f"nats://{n}:4222" for n in NODES)
    for name, s in _rlbus_services(_compose()["services"]).items():
        assert sorted(s["environment"]["RLBUS_NATS_URL"].split(",")) == every, name


def test_every_service_command_exists_in_the_cli_with_its_options():
    for name, s in _rlbus_services(_compose()["services"]).items():
        argv = s["command"]
        cmd = main.commands.get(argv[0])
        assert isinstance(cmd, click.Command), f"{name}: no `rlbus {argv[0]}`"
        known = {opt for p in cmd.params for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
        flags = [a for a in argv[1:] if a.startswith("--")]
        assert set(flags) <= known, f"{name}: unknown options {set(flags) - known}"
        ctx = cmd.make_context(argv[0], list(argv[1:]), resilient_parsing=False)
        assert ctx.params is not None


def _nats_nodes(compose: dict) -> dict:
    return {n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("nats")}


def test_compose_runs_the_nats_server_version_the_wheel_ships():
    shipped = subprocess.run([server_binary(), "--version"], capture_output=True, text=True, check=True).stdout
    version = re.search(r"v(\d+\.\d+\.\d+)", shipped)
    assert version is not None, shipped
    for name, s in _nats_nodes(_compose()).items():
        assert s["image"] == f"nats:{version.group(1)}-alpine", f"{name}: pin the embedded server's version"


def test_compose_nats_nodes_fsync_every_jetstream_write():
    compose = _compose()
    contents = {name: c["content"] for name, c in compose["configs"].items()}
    for name, s in _nats_nodes(compose).items():
        mounted = {c["target"]: contents[c["source"]] for c in s["configs"]}
        config = _flag(s["command"], "-c")
        assert config in mounted, f"{name}: -c {config} is a config compose mounts"
        assert re.search(r"jetstream\s*\{[^}]*sync_interval:\s*always", mounted[config]), name
