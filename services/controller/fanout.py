"""Fan-out: one command to many workers at once, under one deadline, every answer sorted."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import anyio
import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from rlbus.errors import RLBusError, error_for
from rlbus.schemas import AnyCommand, Nack, Subjects, WorkerAck, WorkerFailure, WorkerState, encode, reply_decoder
from rlbus.schemas.codec import DecodeError


class Outcome(msgspec.Struct):
    """What every addressed worker answered."""

    acks: dict[str, WorkerState]
    failures: list[WorkerFailure]

    @property
    def ok(self) -> bool:
        return not self.failures

    def error(self, what: str) -> RLBusError:
        """One error naming every failed worker; its code is the most telling failure's."""
        order = ["UNAVAILABLE", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "ABORTED", "INTERNAL"]
        code = min((f.code for f in self.failures), key=order.index)
        detail = "; ".join(f"{f.worker_id}: {f.code}: {f.message}" for f in self.failures)
        return error_for(code, f"{what} failed on {len(self.failures)} worker(s): {detail}", self.failures)

    def raise_for_failures(self, what: str) -> None:
        if self.failures:
            raise self.error(what)


async def fan_out(
    nc: Client,
    subjects: Subjects,
    worker_ids: list[str],
    command: AnyCommand | Callable[[str], AnyCommand],
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
    op = type(sample).__struct_config__.tag
    out = Outcome(acks={}, failures=[])
    answered: set[str] = set()

    async def one(worker_id: str) -> None:
        try:
            msg = await nc.request(subjects.worker(worker_id, op), payloads[worker_id], timeout=timeout)
        except NoRespondersError:
            out.failures.append(WorkerFailure(worker_id=worker_id, code="UNAVAILABLE", message="worker is gone (no responders)"))
        except (NatsTimeout, TimeoutError):
            out.failures.append(WorkerFailure(worker_id=worker_id, code="DEADLINE_EXCEEDED", message=f"no answer to {op} within {timeout:g}s"))
        except Exception as e:  # connection closed, etc.
            out.failures.append(WorkerFailure(worker_id=worker_id, code="UNAVAILABLE", message=f"{type(e).__name__}: {e}"))
        else:
            out.failures.extend(_sort(worker_id, op, msg, out.acks))
        answered.add(worker_id)

    # All requests go out at once; one deadline bounds the whole fan-out. A plain gather of
    # the request coroutines: a task group's per-task scopes cost ~2x the raw round at N=64.
    with anyio.move_on_after(timeout + 0.5 if math.isfinite(timeout) else None):
        await asyncio.gather(*(one(w) for w in worker_ids))
    for w in worker_ids:
        if w not in answered:
            out.failures.append(WorkerFailure(worker_id=w, code="DEADLINE_EXCEEDED", message=f"no answer to {op} within {timeout:g}s"))
    return out


def _sort(worker_id: str, op: str, msg, acks: dict[str, WorkerState]) -> list[WorkerFailure]:  # noqa: ANN001
    headers = msg.headers or {}
    if "Nats-Service-Error-Code" in headers:
        return [WorkerFailure(worker_id=worker_id, code="INTERNAL", message=f"{op} rejected: {headers.get('Nats-Service-Error', '')}")]
    try:
        reply = reply_decoder.decode(msg.data)
    except DecodeError as e:
        return [WorkerFailure(worker_id=worker_id, code="INTERNAL", message=f"undecodable reply to {op}: {e}")]
    if isinstance(reply, Nack):
        return [WorkerFailure(worker_id=worker_id, code=reply.code, message=reply.message)]
    if isinstance(reply, WorkerAck):
        acks[worker_id] = reply.state
        return []
    return [WorkerFailure(worker_id=worker_id, code="INTERNAL", message=f"unexpected {type(reply).__name__} reply to {op}")]
