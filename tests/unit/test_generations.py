"""A worker's generate runs by request id (services/worker/generations.py): a send again after
the client's link came back joins the run or gets its kept reply, and never runs it twice."""

from __future__ import annotations

import asyncio

import pytest
from rlbus.services.worker import generations as G


class Work:
    """A generation that ends when the test says, counting its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self) -> bytes:
        self.runs += 1
        self.started.set()
        await self.release.wait()
        return f"reply {self.runs}".encode()


async def two_sends(gens: G.Generations, work: Work) -> tuple[asyncio.Task, asyncio.Task]:
    """A request's first send, and a send again while it runs."""
    first = asyncio.create_task(gens.run("r1", work))
    again = asyncio.create_task(gens.run("r1", work))
    await work.started.wait()  # the first runs; the second, started after it, waits on that run
    return first, again


async def test_a_send_again_while_the_request_runs_waits_for_that_run():
    gens, work = G.Generations(), Work()
    first, again = await two_sends(gens, work)
    assert gens.running == 1 and not again.done() and "r1" in gens and "r2" not in gens
    assert gens.runs("r1") and not gens.runs("r2")
    work.release.set()
    assert await first == await again == b"reply 1" and work.runs == 1
    assert not gens.runs("r1") and "r1" in gens, "answered: kept, no longer running"
    assert "r1" in gens, "answered lately: a send again here is this worker's to answer"


async def test_a_send_after_the_run_gets_its_kept_reply():
    gens, work = G.Generations(), Work()
    work.release.set()
    assert await gens.run("r1", work) == b"reply 1"
    assert await gens.run("r1", work) == b"reply 1" and work.runs == 1
    assert await gens.run("r2", work) == b"reply 2", "another id runs"


async def test_a_request_without_an_id_runs_on_every_send():
    gens, work = G.Generations(), Work()
    work.release.set()
    assert [await gens.run(None, work) for _ in range(2)] == [b"reply 1", b"reply 2"]


async def test_a_run_that_ends_without_a_reply_leaves_it_to_the_send_that_waits():
    gens, work = G.Generations(), Work()
    first, again = await two_sends(gens, work)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    work.release.set()
    assert await again == b"reply 2" and work.runs == 2
    assert gens.running == 0


async def test_a_waiting_send_cancelled_leaves_the_run_alone():
    gens, work = G.Generations(), Work()
    first, again = await two_sends(gens, work)
    again.cancel()
    work.release.set()
    assert await first == b"reply 1"


async def test_kept_replies_expire_by_age_and_by_count(monkeypatch):
    now = [0.0]
    gens, work = G.Generations(clock=lambda: now[0]), Work()
    work.release.set()
    await gens.run("old", work)
    now[0] = G.RECENT_S + 1
    assert gens.answered("old") is None and "old" not in gens, "past RECENT_S a send runs it again"
    monkeypatch.setattr(G, "RECENT_MAX", 2)
    for rid in ("a", "b", "c"):
        await gens.run(rid, work)
    assert gens.answered("a") is None and gens.answered("c") is not None


async def test_a_run_that_ends_with_no_reply_is_kept_nowhere_and_the_next_send_runs_it():
    """A worker that stops hands back a request it never started (its work answers None): that
    is no reply to keep, so a send of the id that comes after it runs the request."""
    gens = G.Generations()

    async def not_started() -> bytes | None:
        return None

    assert await gens.run("r1", not_started) is None
    assert "r1" not in gens and gens.answered("r1") is None
    work = Work()
    work.release.set()
    assert await gens.run("r1", work) == b"reply 1"
