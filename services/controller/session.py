"""The weight-update session as a pure state machine: `step(state, event) -> Step`.

No I/O here; updates.py performs what a step asks for and feeds back what happened.

    Idle --Start--> Open --Update*--> Open --Finish--> Committing --Decide--> Decided --CommitDone--> Idle
                     |                 ^                 |
                     |                 +----Reopen-------+
                     +--Abort / WorkerLost / Sleep--> Idle <--Failed--+

Committing is phase 1 (every worker verifies what it staged); any failure there aborts
everywhere, except a finish whose claim the store refused (Reopen: phase 1 only checked, nothing
was decided, and the session stays open for the finish's retry). Decide records the outcome (the decision is in the state store before any worker
commits): from Decided on the outcome is commit, and nothing but CommitDone leaves it; a worker
that fails or misses its commit is quarantined, never rolled back (a commit that loaded into an
engine cannot be taken back).
"""

from __future__ import annotations

from typing import Union

import msgspec
from rlbus.schemas import ErrorCode, UpdateTarget


class Idle(msgspec.Struct, frozen=True, tag="idle"):
    pass


class Open(msgspec.Struct, frozen=True, tag="open"):
    session_id: str
    target: UpdateTarget
    epoch: int
    updates: int = 0


class Committing(msgspec.Struct, frozen=True, tag="committing"):
    session_id: str
    target: UpdateTarget
    epoch: int
    version: str | None
    updates: int = 0
    """The open session's, kept for a Reopen."""


class Decided(msgspec.Struct, frozen=True, tag="decided"):
    session_id: str
    target: UpdateTarget
    epoch: int
    version: str | None
    seq: int
    """The commit sequence the decided bits take."""


SessionState = Union[Idle, Open, Committing, Decided]


# ---- events ------------------------------------------------------------------------------


class Start(msgspec.Struct, frozen=True):
    session_id: str
    target: UpdateTarget
    epoch: int


class Update(msgspec.Struct, frozen=True):
    session_id: str | None = None
    """None = the open session."""


class Finish(msgspec.Struct, frozen=True):
    version: str | None
    session_id: str | None = None


class Decide(msgspec.Struct, frozen=True):
    """Every worker prepared and the decision is durable: the outcome is commit."""

    seq: int


class CommitDone(msgspec.Struct, frozen=True):
    pass


class Reopen(msgspec.Struct, frozen=True):
    """The finish gave way before its decision (its claim was refused, or an earlier run of it
    answers): phase 1 only checked, so the session is open again, as before the finish."""


class Failed(msgspec.Struct, frozen=True):
    reason: str


class Abort(msgspec.Struct, frozen=True):
    session_id: str | None = None


class WorkerLost(msgspec.Struct, frozen=True):
    worker_id: str


class SleepWeights(msgspec.Struct, frozen=True):
    """Weights are going to sleep: an open session cannot survive that."""


class VersionSet(msgspec.Struct, frozen=True):
    """update_weight_version without a transfer."""


Event = Union[Start, Update, Finish, Decide, CommitDone, Reopen, Failed, Abort, WorkerLost, SleepWeights, VersionSet]


class Refusal(msgspec.Struct, frozen=True):
    code: ErrorCode
    message: str


class Step(msgspec.Struct, frozen=True):
    state: SessionState
    refusal: Refusal | None = None
    abort_workers: bool = False
    """True when the step closed an open session: tell every worker to drop staged data."""


def _refuse(state: SessionState, code: ErrorCode, message: str) -> Step:
    return Step(state=state, refusal=Refusal(code=code, message=message))


def _mismatch(state: Open | Committing, session_id: str | None) -> bool:
    return session_id is not None and session_id != state.session_id


def step(state: SessionState, event: Event) -> Step:
    """The next session state for `event`, or a refusal that leaves `state` unchanged."""
    match state, event:
        case Idle(), Start(session_id=sid, target=target, epoch=epoch):
            return Step(state=Open(session_id=sid, target=target, epoch=epoch))
        case Idle(), Update():
            return _refuse(
                state, "FAILED_PRECONDITION", "no weight update session is open; call start_weight_update() first"
            )
        case Idle(), Finish():
            return _refuse(
                state,
                "FAILED_PRECONDITION",
                "finish_weight_update() without a session; call start_weight_update() first",
            )
        case Idle(), (Decide() | Reopen()):
            return _refuse(state, "INTERNAL", "a commit decided or reopened with no session finishing")
        case Idle(), (Abort() | WorkerLost() | SleepWeights() | CommitDone() | Failed() | VersionSet()):
            return Step(state=state)
        case Open(), Start():
            return _refuse(
                state,
                "FAILED_PRECONDITION",
                f"session {state.session_id} ({state.target}) is already open; finish or abort it first",
            )
        case Open(), Update(session_id=sid):
            if _mismatch(state, sid):
                return _refuse(
                    state, "FAILED_PRECONDITION", f"session {sid} is not the open session {state.session_id}"
                )
            return Step(state=Open(state.session_id, state.target, state.epoch, state.updates + 1))
        case Open(), Finish(version=version, session_id=sid):
            if _mismatch(state, sid):
                return _refuse(
                    state, "FAILED_PRECONDITION", f"session {sid} is not the open session {state.session_id}"
                )
            return Step(state=Committing(state.session_id, state.target, state.epoch, version, state.updates))
        case Open(), Abort(session_id=sid):
            if _mismatch(state, sid):
                return _refuse(
                    state, "FAILED_PRECONDITION", f"session {sid} is not the open session {state.session_id}"
                )
            return Step(state=Idle(), abort_workers=True)
        case Open(), (WorkerLost() | SleepWeights() | Failed()):
            return Step(state=Idle(), abort_workers=True)
        case Open(), VersionSet():
            return _refuse(
                state,
                "FAILED_PRECONDITION",
                f"session {state.session_id} is open; finish or abort it before setting the version",
            )
        case Open(), (CommitDone() | Decide() | Reopen()):
            return _refuse(state, "INTERNAL", "commit reported for a session that is not finishing")
        case Committing(), Reopen():
            return Step(state=Open(state.session_id, state.target, state.epoch, state.updates))
        case Committing(), Decide(seq=seq):
            return Step(state=Decided(state.session_id, state.target, state.epoch, state.version, seq))
        case Committing(), CommitDone():
            return _refuse(state, "INTERNAL", f"session {state.session_id} committed before its commit was decided")
        case Committing(), (Failed() | WorkerLost()):
            return Step(state=Idle(), abort_workers=True)
        case Committing(), _:
            return _refuse(state, "FAILED_PRECONDITION", f"session {state.session_id} is being finished; wait for it")
        case Decided(), CommitDone():
            return Step(state=Idle())
        case Decided(), (Failed() | WorkerLost()):
            return _refuse(
                state,
                "FAILED_PRECONDITION",
                f"session {state.session_id} is decided (seq {state.seq}): it commits; a worker that "
                "fails is quarantined, nothing is aborted",
            )
        case Decided(), _:
            return _refuse(
                state,
                "FAILED_PRECONDITION",
                f"session {state.session_id} is decided (seq {state.seq}) and committing; wait for it",
            )
    raise AssertionError(f"unhandled {state!r} + {event!r}")  # pragma: no cover
