"""Every call finishes within its deadline: a push stuck on a worker, a transfer group that
never forms, a second trainer pushing into the first one's session. The controller gives up
with the caller (the command carries its deadline), undoes what it started, and the fleet ends
resumed on the committed version."""

from __future__ import annotations

import asyncio
import time

import pytest

import rlbus
from tests.fleet import fleet_running
from tests.looplag import LoopLag
from tests.waiting import eventually
from tests.weights_helpers import MODEL, assert_holds, new_version, trained

WORKERS = ("w0", "w1")


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(
        nats_server.url, prefix, WORKERS, weight_transfer_backend="gloo", model=MODEL, command_timeout_s=30.0
    ) as running:
        yield running


class Hang:
    """Stands in for a worker step that never finishes (until the test releases it, so the
    fleet can drain when the module ends)."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    async def __call__(self, *args: object, **kw: object) -> None:
        await self.released.wait()
        raise rlbus.Aborted("released by the test")


async def test_a_push_stuck_on_a_worker_ends_within_its_deadline_and_leaves_the_fleet_resumed(fleet, monkeypatch):
    f, rl = fleet
    committed, named = new_version("kept"), trained(71)
    await rl.push_weights(named, committed)
    hang = Hang()
    monkeypatch.setattr(f.workers["w1"].updates, "prepare", hang)  # w1 never reports "staged and verified"
    async with LoopLag(bound=0.3):
        t0 = time.monotonic()
        with pytest.raises(rlbus.DeadlineExceeded):
            await rl.push_weights(trained(72), new_version("late"), timeout=3.0)
        took = time.monotonic() - t0
    print(f"push with a 3 s deadline gave up after {took:.2f}s")
    assert took < 3.5, f"push_weights ran {took:.1f}s past a 3 s deadline"
    monkeypatch.undo()
    hang.released.set()
    info = await rl.server_info()
    assert info.session_id is None and not info.desired.paused
    assert not await rl.is_paused()
    assert info.weight_version == committed and await rl.get_weight_version() == committed
    for wid in f.workers:
        assert_holds(f, wid, named)
    after = new_version("after")
    await rl.push_weights(trained(73), after)
    assert await rl.get_weight_version() == after


async def test_init_weight_transfer_ends_within_the_clients_deadline_when_a_worker_never_joins(fleet, monkeypatch):
    f, rl = fleet
    hang = Hang()
    monkeypatch.setattr(f.workers["w1"].updates, "join", hang)
    rl.timeout, saved = 3.0, rl.timeout
    try:
        t0 = time.monotonic()
        with pytest.raises(rlbus.DeadlineExceeded):
            await rl.init_weight_transfer(timeout_s=60)  # the collective timeout does not stretch the call
        took = time.monotonic() - t0
    finally:
        rl.timeout = saved
    print(f"init_weight_transfer with a 3 s deadline gave up after {took:.2f}s")
    assert took < 3.5
    monkeypatch.undo()
    hang.released.set()
    await rl.init_weight_transfer(timeout_s=10)
    await rl.push_weights(trained(74), new_version("regrouped"))


async def test_a_second_trainers_push_is_refused_at_once_and_the_first_commits(fleet, nats_server, prefix, monkeypatch):
    f, rl = fleet
    gate = asyncio.Event()
    prepare = f.workers["w0"].updates.prepare

    async def held(*args: object, **kw: object) -> None:  # keeps the first push's session open until released
        await gate.wait()
        await prepare(*args, **kw)

    monkeypatch.setattr(f.workers["w0"].updates, "prepare", held)
    first = new_version("first")
    push = asyncio.create_task(rl.push_weights(trained(75), first))
    await eventually(lambda: f.controller.updates.session_id is not None, what="the first push's session open")
    sid = f.controller.updates.session_id
    async with await rlbus.RLClient.connect(nats_server.url, prefix=prefix, timeout=20.0) as other:
        t0 = time.monotonic()
        with pytest.raises(rlbus.FailedPrecondition, match=sid):
            await other.push_weights(trained(76), new_version("second"))
        assert time.monotonic() - t0 < 2.0, "the second push was not refused at once"
    gate.set()
    await push
    assert await rl.get_weight_version() == first
    assert not await rl.is_paused()
