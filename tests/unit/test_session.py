"""The controller's session state machine, from a table; no server."""

from __future__ import annotations

import pytest
from rlbus.services.controller.session import (
    Abort,
    CommitDone,
    Committing,
    Decide,
    Decided,
    Failed,
    Finish,
    Idle,
    Open,
    Reopen,
    SleepWeights,
    Start,
    Update,
    VersionSet,
    WorkerLost,
    step,
)

OPEN = Open(session_id="s1", target="main", epoch=1)
COMMITTING = Committing(session_id="s1", target="main", epoch=1, version="v1")
DECIDED = Decided(session_id="s1", target="main", epoch=1, version="v1", seq=7)

# (state, event, next state or None when refused, refusal code, abort workers)
TABLE = [
    (Idle(), Start("s1", "main", 1), OPEN, None, False),
    (Idle(), Update(), None, "FAILED_PRECONDITION", False),
    (Idle(), Finish("v1"), None, "FAILED_PRECONDITION", False),
    (Idle(), Abort(), Idle(), None, False),
    (Idle(), VersionSet(), Idle(), None, False),
    (OPEN, Start("s2", "main", 1), None, "FAILED_PRECONDITION", False),
    (OPEN, Update(), Open("s1", "main", 1, 1), None, False),
    (OPEN, Update("other"), None, "FAILED_PRECONDITION", False),
    (OPEN, Finish("v1"), COMMITTING, None, False),
    (OPEN, Finish("v1", "other"), None, "FAILED_PRECONDITION", False),
    (OPEN, Abort(), Idle(), None, True),
    (OPEN, WorkerLost("w1"), Idle(), None, True),
    (OPEN, SleepWeights(), Idle(), None, True),
    (OPEN, VersionSet(), None, "FAILED_PRECONDITION", False),
    (COMMITTING, Decide(7), DECIDED, None, False),
    (COMMITTING, CommitDone(), None, "INTERNAL", False),
    (COMMITTING, Failed("nack"), Idle(), None, True),
    (COMMITTING, WorkerLost("w0"), Idle(), None, True),
    (COMMITTING, Start("s2", "main", 1), None, "FAILED_PRECONDITION", False),
    (COMMITTING, Update(), None, "FAILED_PRECONDITION", False),
    # a finish whose claim was refused (or an earlier run of it answers): open again, nothing aborted
    (Committing("s1", "main", 1, "v1", 3), Reopen(), Open("s1", "main", 1, 3), None, False),
    (Open("s1", "main", 1, 3), Finish("v1"), Committing("s1", "main", 1, "v1", 3), None, False),
    (Idle(), Reopen(), None, "INTERNAL", False),
    (OPEN, Reopen(), None, "INTERNAL", False),
    (DECIDED, Reopen(), None, "FAILED_PRECONDITION", False),
    (Idle(), Decide(1), None, "INTERNAL", False),
    (OPEN, Decide(1), None, "INTERNAL", False),
    # from the decision on the outcome is commit: nothing aborts it
    (DECIDED, CommitDone(), Idle(), None, False),
    (DECIDED, Failed("a worker failed its commit"), None, "FAILED_PRECONDITION", False),
    (DECIDED, WorkerLost("w0"), None, "FAILED_PRECONDITION", False),
    (DECIDED, Abort(), None, "FAILED_PRECONDITION", False),
    (DECIDED, Abort("s1"), None, "FAILED_PRECONDITION", False),
    (DECIDED, SleepWeights(), None, "FAILED_PRECONDITION", False),
    (DECIDED, Start("s2", "main", 1), None, "FAILED_PRECONDITION", False),
    (DECIDED, Finish("v2"), None, "FAILED_PRECONDITION", False),
    (DECIDED, Decide(8), None, "FAILED_PRECONDITION", False),
]


@pytest.mark.parametrize(
    "state,event,expected,code,abort", TABLE, ids=[f"{type(r[0]).__name__}+{type(r[1]).__name__}" for r in TABLE]
)
def test_session_step_follows_the_table(state, event, expected, code, abort):
    out = step(state, event)
    if code is None:
        assert out.refusal is None
        assert out.state == expected
    else:
        assert out.refusal is not None and out.refusal.code == code
        assert out.state == state, "a refusal leaves the state unchanged"
    assert out.abort_workers is abort


def test_finish_without_start_is_refused_with_a_hint():
    out = step(Idle(), Finish("v"))
    assert "start_weight_update" in out.refusal.message


def test_a_full_session_returns_to_idle():
    st = Idle()
    for ev in [Start("s", "draft", 2), Update(), Update(), Finish(None), Decide(1), CommitDone()]:
        out = step(st, ev)
        assert out.refusal is None
        st = out.state
    assert st == Idle()
