"""The permission matrix in docs/security.md is the one the config is written from."""

from __future__ import annotations

from pathlib import Path

from rlbus.runners.natsconfig import permission_matrix

ROOT = Path(__file__).resolve().parents[2]


def test_the_security_page_shows_the_permission_matrix_the_config_is_written_from():
    readme = (ROOT / "docs" / "security.md").read_text()
    shown = readme.split("<!-- permission-matrix -->\n", 1)[1].split("\n<!-- /permission-matrix -->", 1)[0]
    assert shown == permission_matrix("rl")


def test_a_worker_may_speak_and_listen_only_under_its_own_id():
    matrix = permission_matrix("rl")
    row = next(line for line in matrix.splitlines() if line.startswith("| worker-<id>"))
    assert "`rl.workers.<id>.*`" in row and "`rl.worker.<id>.*`" in row
    assert "rl.worker.*.*" not in row and "_INBOX.>" not in row
