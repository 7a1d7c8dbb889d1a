"""Pub/sub messages: handshakes, liveness and fleet events."""

from __future__ import annotations

from typing import Literal, Union

from .base import Message
from .state import Capabilities, WorkerState

EventKind = Literal[
    "paused",
    "resumed",
    "sleeping",
    "awake",
    "worker_joined",
    "worker_left",
    "worker_stale",
    "session_started",
    "session_aborted",
    "session_committed",
    "progress",
    "worker_reconciled",
    "state_lost",
    "worker_repaired",
    "repair_failed",
    "repair_waiting",
    "worker_quarantined",
    "worker_released",
]


class WorkerReady(Message, frozen=True, kw_only=True, tag="worker_ready"):
    """worker -> controller on rl.worker.ready: who I am and what I can do."""

    worker_id: str
    capabilities: Capabilities
    state: WorkerState


class Heartbeat(Message, frozen=True, kw_only=True, tag="heartbeat"):
    worker_id: str
    state: WorkerState


class WorkerGone(Message, frozen=True, kw_only=True, tag="worker_gone"):
    worker_id: str
    reason: str = ""


class ControllerHello(Message, frozen=True, kw_only=True, tag="controller_hello"):
    """controller -> all workers: re-announce yourselves."""

    epoch: int = 0
    controller_id: str = ""


class FleetEvent(Message, frozen=True, kw_only=True, tag="fleet_event"):
    """Published on rl.events.<event>."""

    event: EventKind
    epoch: int = 0
    workers: list[str] = []
    detail: str = ""
    session_id: str | None = None
    time: float = 0.0


AnyEvent = Union[WorkerReady, Heartbeat, WorkerGone, ControllerHello, FleetEvent]
