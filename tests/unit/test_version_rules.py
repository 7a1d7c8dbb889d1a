"""Which weight-version strings are acceptable (rlbus.schemas.version_problem)."""

from __future__ import annotations

import pytest
from rlbus.schemas import MAX_VERSION_LEN, version_problem


@pytest.mark.parametrize("version", ["step-1", "v2.0+rc1", "default", "x" * MAX_VERSION_LEN, "ümlaut-ok", "with space"])
def test_normal_versions_are_accepted(version):
    assert version_problem(version) is None


@pytest.mark.parametrize("version", ["", " ", "\t"])
def test_empty_or_blank_versions_are_refused(version):
    problem = version_problem(version)
    assert problem is not None and "empty" in problem


def test_a_version_longer_than_the_limit_is_refused():
    assert MAX_VERSION_LEN == 128
    problem = version_problem("x" * (MAX_VERSION_LEN + 1))
    assert problem is not None and str(MAX_VERSION_LEN) in problem


@pytest.mark.parametrize("version", ["step\n1", "tab\tinside", "nul\x00", "bell\x07", "esc\x1b[0m", "zero\u200bwidth"])
def test_non_printable_versions_are_refused(version):
    problem = version_problem(version)
    assert problem is not None and "printable" in problem
