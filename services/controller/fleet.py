"""The fleet as the controller addresses it: the registry, this controller's epoch, the one
lock for state changes, fan-out stamped with the epoch, fleet events and the FleetAck builder.
The service (service.py) and the update handlers (updates.py) are both built on it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from nats.aio.client import Client
from rlbus.schemas import (
    AnyWorkerCommand,
    EventKind,
    FleetAck,
    FleetEvent,
    Subjects,
    Unavailable,
    encode,
)
from rlbus.services.endpoints import ClaimOutcome, claimed
from rlbus.services.metrics import ControllerMetrics

from .fanout import FanOut, Outcome
from .registry import Registry

log = logging.getLogger("rlbus.controller")
T = TypeVar("T")

Unstamped = Callable[[str, int, str], AnyWorkerCommand]
"""Builds the command for (worker_id, epoch, command_id): the fleet stamps every command it
sends with its epoch (fencing) and one fresh id per fan-out."""


class Fleet:
    def __init__(self, nc: Client, subjects: Subjects, registry: Registry, command_timeout_s: float) -> None:
        self.nc = nc
        self.subjects = subjects
        self.registry = registry
        self.command_timeout_s = command_timeout_s
        """Deadline of one fan-out (every worker must answer within it)."""
        self.epoch = 0
        """This controller's epoch (taken from KV when it became leader); stamps every command."""
        self.lock = anyio.Lock()
        """One state-changing operation at a time; reads never take it."""
        self.on_lost: Callable[[str, str], Awaitable[None]] = _nobody_listens
        """Called with (worker_id, why) when a fan-out finds a worker gone."""
        self.metrics: ControllerMetrics | None = None
        self.fan_out = FanOut(nc, subjects)

    def ids(self) -> list[str]:
        """Every registered worker in rank order; UNAVAILABLE when there are none."""
        ids = self.registry.ids()
        if not ids:
            raise Unavailable("no workers are registered; start workers (rlbus worker) and retry")
        return ids

    async def send(self, build: Unstamped, workers: list[str] | None = None, timeout: float | None = None) -> Outcome:
        """The command `build` makes for each worker, to every worker at once, under one
        deadline. One fresh command id per fan-out: the trainer's id dedups at the
        controller, this one at the workers."""
        workers = self.ids() if workers is None else workers
        command_id = uuid.uuid4().hex
        command: AnyWorkerCommand | Callable[[str], AnyWorkerCommand] = (
            build("", self.epoch, command_id)  # one command for all: built and encoded once
            if isinstance(build, Stamped)
            else lambda w: build(w, self.epoch, command_id)
        )
        out = await self.fan_out(workers, command, timeout or self.command_timeout_s)
        if self.metrics is not None:
            self.metrics.fanned_out(out.op, out.seconds, [(f.worker_id, f.code) for f in out.failures])
        for state in out.acks.values():
            self.registry.seen(state)
        gone = [f for f in out.failures if f.code == "UNAVAILABLE"]
        if gone:
            try:
                await claimed()  # a command refused for want of quorum changes nothing, the registry included
            except ClaimOutcome:
                return out
            for f in gone:
                await self.on_lost(f.worker_id, f.message)
        return out

    async def send_all(self, build: Unstamped, what: str) -> Outcome:
        """send() to every worker; raise the error naming each one that failed."""
        out = await self.send(build)
        out.raise_for_failures(what)
        return out

    def ack(self, out: Outcome, *, session_id: str | None, weight_version: str) -> FleetAck:
        """What every worker answered, in rank order, with the fleet's session and version."""
        return FleetAck(
            workers=[out.acks[w] for w in sorted(out.acks)],
            session_id=session_id,
            weight_version=weight_version,
            epoch=self.epoch,
        )

    async def event(self, kind: EventKind, workers: list[str], detail: str = "", session_id: str | None = None) -> None:
        ev = FleetEvent(
            event=kind, epoch=self.epoch, workers=workers, detail=detail, session_id=session_id, time=time.time()
        )
        if self.metrics is not None:
            self.metrics.event(ev)
        try:
            await self.nc.publish(self.subjects.event(kind), encode(ev))
        except Exception as e:  # events are best effort; state lives in KV and replies
            log.debug("event %s not published: %s", kind, e)


class Stamped:
    """A builder for one command the same for every worker (but its stamp): the fleet builds
    and encodes it once per fan-out."""

    def __init__(self, command: type[AnyWorkerCommand], fields: dict[str, object]) -> None:
        self.command, self.fields = command, fields

    def __call__(self, _worker_id: str, epoch: int, command_id: str) -> AnyWorkerCommand:
        return self.command(epoch=epoch, command_id=command_id, **self.fields)  # type: ignore[arg-type]


def stamped(command: type[AnyWorkerCommand], **fields: object) -> Unstamped:
    """A builder for one command the same for every worker (but its stamp)."""
    return Stamped(command, fields)


async def alongside(persist: Awaitable[object], work: Awaitable[T]) -> T:
    """Run `work` (a fan-out) while `persist` writes to KV: the answer waits for both, so it is
    durable when answered, at the cost of the slower of the two. The fan-out's error first.
    The write runs as a future of the loop's (as `together`'s do: a task in an anyio group costs
    ~30 us a command); it is cancelled if the caller is, and awaited to its end otherwise."""
    saving = asyncio.ensure_future(persist)
    try:
        result = await work
    except BaseException as e:
        if not isinstance(e, Exception):  # cancelled (the caller's deadline): the write goes too
            saving.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(saving, return_exceptions=True)
        raise
    await saving  # its error, if it failed
    return result


async def together(*writes: Awaitable[object]) -> None:
    """Independent KV writes at once (one round trip's wait, not one each); every one runs to
    its end, then the first error is raised."""
    outcomes = await asyncio.gather(*writes, return_exceptions=True)
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o


async def _nobody_listens(worker_id: str, why: str) -> None:
    return None
