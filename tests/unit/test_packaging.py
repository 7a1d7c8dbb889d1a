"""The wheel ships every package: pyproject's explicit package list covers every folder."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_python_package_folder_is_in_the_wheel():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / path for name, path in cfg["package-dir"].items()}
    assert set(cfg["packages"]) == set(dirs)
    shipped = {p.resolve() for p in dirs.values()}
    for top in ("rlbus", "schemas", "services"):
        for init in (ROOT / top).rglob("__init__.py"):
            assert init.parent.resolve() in shipped, f"{init.parent} is not packaged"


def test_the_console_script_points_at_the_cli():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["project"]["scripts"]["rlbus"] == "rlbus.runners.cli:main"
    from rlbus.runners.cli import main

    assert {"up", "demo", "controller", "worker", "status", "nats-config"} <= set(main.commands)
