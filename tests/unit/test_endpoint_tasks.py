"""Endpoints run each spawned command in a task of the service's task group and reuse the task
once its command answered (a parked task takes the next command: no task is started per command
on a busy service); every command is answered, concurrent ones each in a task of their own, and a
parked task cancelled with the group is never handed a command; no server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from rlbus.services.endpoints import PARKED_RUNNERS, Endpoints

from tests.micro_requests import Req


class CountingGroup:
    """A real task group that counts the tasks started in it."""

    def __init__(self, tg) -> None:
        self.tg, self.started = tg, 0

    def start_soon(self, fn, *args) -> None:
        self.started += 1
        self.tg.start_soon(fn, *args)


@asynccontextmanager
async def _counted() -> AsyncIterator[tuple[CountingGroup, Endpoints]]:
    """Endpoints in a task group that counts the tasks it starts; the group is cancelled after."""
    async with anyio.create_task_group() as tg:
        group = CountingGroup(tg)
        yield group, Endpoints(group, "test")  # type: ignore[arg-type]
        tg.cancel_scope.cancel()


def _spawned(eps: Endpoints, n: int, data: bytes, gate: anyio.Event | None = None) -> list[Req]:
    reqs = [Req() for _ in range(n)]
    for req in reqs:
        eps.spawn(req, _answering(data, gate))  # type: ignore[arg-type]
    return reqs


async def _all_answered_and_parked(eps: Endpoints) -> None:
    with anyio.fail_after(5):
        await eps.wait_idle()
    await anyio.wait_all_tasks_blocked()


def _answering(data: bytes, gate: anyio.Event | None = None):
    async def work() -> bytes:
        if gate is not None:
            await gate.wait()
        return data

    return work


async def test_commands_one_after_another_run_in_one_task():
    async with _counted() as (group, eps):
        for k in range(5):
            req = Req()
            eps.spawn(req, _answering(b"%d" % k))  # type: ignore[arg-type]
            with anyio.fail_after(5):
                await req.answered.wait()
            assert req.answer == b"%d" % k
            await anyio.wait_all_tasks_blocked()  # the task parks once it answered
        assert group.started == 1, f"{group.started} tasks for 5 commands one after another"
        with anyio.fail_after(5):
            await eps.wait_idle()


async def test_concurrent_commands_each_get_a_task_and_the_parked_tasks_take_the_next_ones():
    async with _counted() as (group, eps):
        gate = anyio.Event()
        first = _spawned(eps, 3, b"held", gate)
        await anyio.wait_all_tasks_blocked()
        assert group.started == 3 and eps.in_flight == 3 and not any(r.answered.is_set() for r in first)
        gate.set()
        await _all_answered_and_parked(eps)
        second = _spawned(eps, 3, b"next")
        await _all_answered_and_parked(eps)
        assert [r.answer for r in first + second] == [b"held"] * 3 + [b"next"] * 3
        assert group.started == 3, "a parked task was not reused"


async def test_no_more_tasks_park_than_the_limit():
    async with _counted() as (group, eps):
        gate = anyio.Event()
        _spawned(eps, PARKED_RUNNERS + 4, b"x", gate)
        gate.set()
        await _all_answered_and_parked(eps)
        assert len(eps._parked) == PARKED_RUNNERS


async def test_a_task_cancelled_while_parked_leaves_the_pool():
    async with anyio.create_task_group() as outer:
        eps = Endpoints(outer, "test")
        async with anyio.create_task_group() as inner:
            eps._tg = inner  # the runner lives in `inner`, which is cancelled below
            req = Req()
            eps.spawn(req, _answering(b"x"))  # type: ignore[arg-type]
            with anyio.fail_after(5):
                await req.answered.wait()
            await anyio.wait_all_tasks_blocked()
            assert len(eps._parked) == 1
            inner.cancel_scope.cancel()
        assert not eps._parked, "a cancelled task stayed parked: a command handed to it would never run"
        eps._tg = outer
        req = Req()
        eps.spawn(req, _answering(b"y"))  # type: ignore[arg-type]
        with anyio.fail_after(5):
            await req.answered.wait()
        assert req.answer == b"y"
        outer.cancel_scope.cancel()
