"""compose.yaml parses and runs only commands and options the CLI has."""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from rlbus.runners.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_has_nats_with_jetstream_controller_workers_and_trainer():
    services = _compose()["services"]
    assert {"nats", "controller", "worker", "trainer"} <= set(services)
    assert "-js" in services["nats"]["command"]
    assert services["worker"]["deploy"]["replicas"] == 2
    for name in ("controller", "worker", "trainer"):
        assert services[name]["environment"]["RLBUS_NATS_URL"] == "nats://nats:4222"


def test_every_service_command_exists_in_the_cli_with_its_options():
    services = _compose()["services"]
    for name in ("controller", "worker", "trainer"):
        argv = services[name]["command"]
        cmd = main.commands.get(argv[0])
        assert isinstance(cmd, click.Command), f"{name}: no `rlbus {argv[0]}`"
        known = {opt for p in cmd.params for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
        flags = [a for a in argv[1:] if a.startswith("--")]
        assert set(flags) <= known, f"{name}: unknown options {set(flags) - known}"
        ctx = cmd.make_context(argv[0], list(argv[1:]), resilient_parsing=False)
        assert ctx.params is not None
