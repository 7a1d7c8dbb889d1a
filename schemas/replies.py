"""Replies. A refusal is a typed Nack with a code; success is a typed reply."""

from __future__ import annotations

from typing import Union

import msgspec

from .base import Message
from .codes import ErrorCode
from .state import DEFAULT_VERSION, Capabilities, FleetState, WorkerInfo, WorkerState


class WorkerFailure(msgspec.Struct, frozen=True, kw_only=True):
    """Why one worker failed a fan-out, or stands in the way of a command (busy, asleep, lacking
    a capability): every refusal that concerns workers names each one here."""

    worker_id: str
    code: ErrorCode
    message: str


class Nack(Message, frozen=True, kw_only=True, tag="nack"):
    code: ErrorCode
    message: str
    """Says what went wrong and how to fix it."""
    failures: list[WorkerFailure] = []
    """Per-worker causes, when the refusal came from the fleet."""


class WorkerAck(Message, frozen=True, kw_only=True, tag="worker_ack"):
    """A worker ran the command; its state afterwards."""

    state: WorkerState


class FleetAck(Message, frozen=True, kw_only=True, tag="fleet_ack"):
    """Every worker ran the command; their states afterwards, in rank order."""

    workers: list[WorkerState]
    answer: bool | None = None
    """The fleet's answer to a question: is_paused (every worker paused), is_sleeping (any
    worker has a part asleep); None for other commands."""
    session_id: str | None = None
    weight_version: str | None = None
    epoch: int = 0


class ServerInfo(Message, frozen=True, kw_only=True, tag="server_info"):
    workers: list[WorkerInfo]
    capabilities: Capabilities
    """AND-aggregated over workers; a backend counts only if every worker has the same one."""
    epoch: int = 0
    weight_version: str = DEFAULT_VERSION
    weight_seq: int = 0
    """Commit sequence of the committed version (VersionInfo.seq)."""
    draft_version: str | None = None
    session_id: str | None = None
    controller_id: str = ""
    desired: FleetState = FleetState()
    """The state every worker is reconciled to (paused, sleeping) as the trainer last set it."""


class VersionInfo(Message, frozen=True, kw_only=True, tag="version"):
    """The committed weight version; also the body of every rl.version event."""

    version: str
    seq: int = 0
    """Commit sequence of `version`: one more with every commit of the main weights (or
    update_weight_version). Version strings are free-form; this orders them, so staleness is
    a subtraction (`current.seq - reply.weight_seq`)."""
    draft_version: str | None = None
    draft_seq: int = 0
    """The same for the draft model."""
    epoch: int = 0
    session_id: str | None = None
    workers: int = 0
    time: float = 0.0


AnyReply = Union[Nack, WorkerAck, FleetAck, ServerInfo, VersionInfo]
