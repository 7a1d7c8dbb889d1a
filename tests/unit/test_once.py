"""`once`: the last commit's record (its version acknowledged, its event confirmed, its decision
marked done) runs once, whoever needs it first (the reply's settle, or the next commit), and
runs again for the next caller when it failed (a store that refused the write)."""

from __future__ import annotations

import anyio
import pytest

from rlbus.bus.once import once


async def test_concurrent_callers_share_one_run_and_later_ones_its_result():
    runs = 0
    gate = anyio.Event()

    async def record() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return runs

    recorded = once(record)
    results: list[int] = []
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(lambda: _append(results, recorded))
        await anyio.wait_all_tasks_blocked()
        gate.set()
    assert results == [1, 1, 1] and await recorded() == 1 and runs == 1


async def _append(results: list[int], call) -> None:
    results.append(await call())


async def test_a_run_that_failed_is_run_again_by_the_next_caller():
    attempts = 0

    async def record() -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("the store refused the version")
        return "recorded"

    recorded = once(record)
    with pytest.raises(RuntimeError):
        await recorded()
    assert await recorded() == "recorded" and await recorded() == "recorded" and attempts == 2
