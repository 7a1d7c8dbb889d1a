"""Fan-out: one command to many workers at once, under one deadline, every answer sorted."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from secrets import token_hex

import anyio
import msgspec
from nats.aio.client import NO_RESPONDERS_STATUS as NO_RESPONDERS
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from rlbus.schemas import (
    ERROR_CODES,
    AnyWorkerCommand,
    RLBusError,
    Subjects,
    WorkerAck,
    WorkerFailure,
    WorkerState,
    encode,
    error_for,
    op_of,
)

from rlbus.bus.faults import Fault, fault_of, reply_of

log = logging.getLogger("rlbus.controller.fanout")


class Outcome(msgspec.Struct):
    """What every addressed worker answered."""

    acks: dict[str, WorkerState]
    failures: list[WorkerFailure]
    op: str = ""
    seconds: dict[str, float] = msgspec.field(default_factory=dict)
    """How long each worker that answered took (metrics: per-worker ack latency)."""
    answers: dict[str, WorkerAck] = msgspec.field(default_factory=dict)
    """Each answer whole (what a command returns beside the state, e.g. hash_weights' checksums)."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def error(self, what: str) -> RLBusError:
        """One error naming every failed worker; its code is the most telling failure's."""
        code = min((f.code for f in self.failures), key=ERROR_CODES.index)
        detail = "; ".join(f"{f.worker_id}: {f.code}: {f.message}" for f in self.failures)
        return error_for(code, f"{what} failed on {len(self.failures)} worker(s): {detail}", self.failures)

    def raise_for_failures(self, what: str) -> None:
        if self.failures:
            raise self.error(what)


class FanOut:
    """Fan-outs over one connection: every command goes out at once with a reply subject of its
    own (`<inbox>.<token>`, a fresh unguessable token per worker and fan-out: a worker cannot
    answer for another) on one wildcard subscription the fan-outs share, and one deadline
    bounds them all. One subscription and one wait per fan-out, not a request (a
    future, a timer, a task waking) per worker: at 64 workers that is most of what a fan-out
    costs beside the round trips."""

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._open: dict[str, tuple[Callable[[str, Msg], None], str]] = {}
        """Each reply subject's token a fan-out waits on: what takes the answer, and for which worker."""

    async def _on_answer(self, msg: Msg) -> None:
        waiter = self._open.pop(msg.subject[len(self._inbox) + 1 :], None)
        if waiter is not None:  # else: a second answer, or one to a fan-out that gave up on it
            take, worker_id = waiter
            take(worker_id, msg)

    async def __call__(
        self,
        worker_ids: list[str],
        command: AnyWorkerCommand | Callable[[str], AnyWorkerCommand],
        timeout: float,
    ) -> Outcome:
        """Send `command` (or `command(worker_id)`) to every worker concurrently; collect an
        answer from each within `timeout`."""
        if callable(command):
            payloads = {w: encode(command(w)) for w in worker_ids}
            sample = command(worker_ids[0]) if worker_ids else None
        else:
            shared = encode(command)  # encoded once for the whole fleet
            payloads = dict.fromkeys(worker_ids, shared)
            sample = command
        op = op_of(sample) if sample is not None else ""
        out = Outcome(acks={}, failures=[], op=op)
        if not worker_ids:
            return out
        if self._sub is None:
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_answer)
        noise = token_hex(8 * len(worker_ids))  # 64 random bits per worker, drawn at once
        tokens = {w: noise[16 * i : 16 * i + 16] for i, w in enumerate(worker_ids)}
        waiting = set(worker_ids)
        sent: dict[str, float] = {}
        all_in = asyncio.get_running_loop().create_future()

        def settle(worker_id: str, got: WorkerAck | Fault) -> None:
            waiting.discard(worker_id)
            if isinstance(got, Fault):
                out.failures.append(WorkerFailure(worker_id=worker_id, code=got.code, message=got.message))
            else:
                out.acks[worker_id] = got.state
                out.answers[worker_id] = got
            out.seconds[worker_id] = time.monotonic() - sent[worker_id]
            if not waiting and not all_in.done():
                all_in.set_result(None)

        def take(worker_id: str, msg: Msg) -> None:
            if worker_id not in waiting:
                return
            if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
                settle(worker_id, fault_of(NoRespondersError(), who=f"worker {worker_id}", op=op, timeout=timeout))
                return
            got = reply_of(msg, op, WorkerAck)
            if isinstance(got, WorkerAck) and got.state.worker_id != worker_id:
                # only the addressed worker answers for itself: an ack about another is forged or misrouted
                log.warning(
                    "ignored an answer to %s for worker %s that speaks for %s", op, worker_id, got.state.worker_id
                )
                got = Fault(
                    "INTERNAL", f"the answer to {op} came from {got.state.worker_id!r}, not the addressed worker"
                )
            settle(worker_id, got)

        for w, token in tokens.items():
            self._open[token] = (take, w)
        try:
            with anyio.move_on_after(timeout if math.isfinite(timeout) else None):
                for w in worker_ids:  # all go out at once: publishing only fills the connection's buffer
                    sent[w] = time.monotonic()
                    try:
                        await self.nc.publish(
                            self.subjects.worker(w, op), payloads[w], reply=f"{self._inbox}.{tokens[w]}"
                        )
                    except Exception as e:  # connection closed, payload over the server's limit
                        settle(w, fault_of(e, who=f"worker {w}", op=op, timeout=timeout))
                if waiting:
                    await all_in
        finally:
            for token in tokens.values():
                self._open.pop(token, None)
        for w in worker_ids:
            if w in waiting:
                late = fault_of(TimeoutError(), who=f"worker {w}", op=op, timeout=timeout)
                out.failures.append(WorkerFailure(worker_id=w, code=late.code, message=late.message))
        return out
