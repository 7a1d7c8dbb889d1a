"""The import rules of ../shared/ARCHITECTURE.md, checked on the source: the schemas are a
leaf, the SDK wing never imports the services, the services never import the SDK or the
runners, only the runners import the services, and no project modules import each other in
a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    """Every project module by its import name, from pyproject's package-dir map."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in dirs.items():
        for path in (ROOT / folder).glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Project modules `name` imports anywhere in its body (type-checking-only imports too)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            while t and t not in MODULES:  # `from rlbus.schemas.codec import X` -> rlbus.schemas.codec
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _in(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_module_map_finds_every_wing():
    for package in (
        "rlbus.schemas",
        "rlbus.bus",
        "rlbus.sdk",
        "rlbus.transfer",
        "rlbus.models",
        "rlbus.services.controller",
        "rlbus.services.worker",
        "rlbus.runners",
    ):
        assert any(_in(m, package) for m in MODULES), package
    assert "rlbus.schemas" in GRAPH["rlbus.services.controller.fleet"]
    assert "rlbus.sdk.push" in GRAPH["rlbus.sdk.client"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, "rlbus.schemas")))
def test_the_schemas_are_a_leaf(module):
    assert all(_in(m, "rlbus.schemas") for m in GRAPH[module]), GRAPH[module]


@pytest.mark.parametrize(
    "module",
    sorted(m for m in MODULES if _in(m, "rlbus.sdk", "rlbus.bus", "rlbus.transfer", "rlbus.models") or m == "rlbus"),
)
def test_the_sdk_wing_imports_neither_services_nor_runners(module):
    bad = {m for m in GRAPH[module] if _in(m, "rlbus.services", "rlbus.runners")}
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, "rlbus.services")))
def test_the_services_import_neither_the_sdk_nor_the_runners(module):
    bad = {m for m in GRAPH[module] if _in(m, "rlbus.sdk", "rlbus.runners") or m == "rlbus"}
    assert not bad, f"{module} imports {bad}"


def test_only_the_runners_import_the_services():
    importers = {
        m for m, deps in GRAPH.items() if not _in(m, "rlbus.services") and any(_in(d, "rlbus.services") for d in deps)
    }
    assert importers and all(_in(m, "rlbus.runners") for m in importers), importers


def test_no_project_modules_import_each_other_in_a_cycle():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(d) :] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


ENGINE_MODULES = sorted(
    [
        *(p for m, p in MODULES.items() if _in(m, "rlbus.services.worker.vllm")),
        MODULES["rlbus.services.worker.engine"],
        MODULES["rlbus.services.worker.reference_engine"],
        ROOT / "bench" / "weightless.py",
    ]
)
"""Where engines live: they run the model and read the worker's books, never write them."""

BOOKKEEPING = {"weight_version", "weight_seq", "draft_version", "draft_seq", "dirty", "withheld", "epoch"}
"""The worker's state fields: the books hold them (services/worker/book.py)."""


def _book_writers() -> set[str]:
    """The Book methods that change it (every public method but the `holds` check; reads are properties)."""
    from rlbus.services.worker.book import Book

    return {n for n, v in vars(Book).items() if callable(v) and not n.startswith("_") and n != "holds"}


@pytest.mark.parametrize("path", ENGINE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_engine_writes_the_workers_version_seq_or_dirty_state(path):
    writers, bad = _book_writers(), []
    assert {"commit", "relabel", "tear", "withhold"} <= writers
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        bad += [
            f"line {t.lineno}: assigns .{t.attr}"
            for t in targets
            if isinstance(t, ast.Attribute) and t.attr in BOOKKEEPING
        ]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in writers
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "book"
        ):
            bad.append(f"line {node.lineno}: calls book.{node.func.attr}()")
    assert not bad, f"{path.name} writes the worker's books: {bad}"
