"""A command answered inline whose answer is kept in memory (every worker command: no gate, no
durable store) runs once per command id: a resend is answered from memory, a resend that arrives
while the first send still runs waits for it and shares its answer, an id reused for another
payload is refused, a handler's bug answers INTERNAL and the service answers on; a command
without an id runs every time. Through the endpoint's real request callback; no server."""

from __future__ import annotations

import anyio
import msgspec
from rlbus.schemas import Nack, PauseWorker, WorkerAck, WorkerState, encode
from rlbus.services.endpoints import Endpoints, Routes

from tests.micro_requests import Req


class Group:
    """Records the handler each endpoint would serve."""

    def __init__(self) -> None:
        self.handlers: dict = {}

    async def add_endpoint(self, *, name, subject, handler, metadata) -> None:
        self.handlers[name] = handler


class Worker:
    """A pause handler that counts its runs; `hold` (when set) keeps a run waiting on it."""

    def __init__(self) -> None:
        self.runs = 0
        self.hold: anyio.Event | None = None
        self.fail = False

    async def pause(self, cmd: PauseWorker) -> WorkerAck:
        self.runs += 1
        if self.hold is not None:
            await self.hold.wait()
        if self.fail:
            raise RuntimeError("the engine broke")
        return WorkerAck(state=WorkerState(worker_id=f"run{self.runs}", pause_mode=cmd.mode))


async def _served(tg, worker: Worker):
    routes = Routes()
    routes.add(PauseWorker, worker.pause, inline=True)
    group = Group()
    eps = Endpoints(tg, "worker w")
    await eps.serve(group, routes)  # type: ignore[arg-type]
    deliver = group.handlers["pause"]  # what the micro service calls with each request

    async def send(cmd: PauseWorker) -> Req:
        req = Req(encode(cmd))
        await deliver(req)
        return req

    return deliver, send


def _ack(req: Req) -> WorkerAck | Nack:
    assert req.answer is not None
    return msgspec.json.decode(req.answer, type=WorkerAck | Nack)


async def test_a_resent_command_is_answered_from_memory_and_runs_once():
    worker = Worker()
    async with anyio.create_task_group() as tg:
        _, send = await _served(tg, worker)
        first = await send(PauseWorker(mode="abort", epoch=0, command_id="c1"))
        again = await send(PauseWorker(mode="abort", epoch=0, command_id="c1"))
        assert first.answer == again.answer and worker.runs == 1
        other = await send(PauseWorker(mode="abort", epoch=0, command_id="c2"))
        assert worker.runs == 2 and _ack(other).state.worker_id == "run2"  # type: ignore[union-attr]
        tg.cancel_scope.cancel()


async def test_a_resend_that_arrives_while_the_first_runs_waits_and_shares_its_answer():
    worker = Worker()
    worker.hold = anyio.Event()
    async with anyio.create_task_group() as tg:
        deliver, _ = await _served(tg, worker)
        first = Req(encode(PauseWorker(mode="keep", epoch=0, command_id="c1")))
        again = Req(first.data)
        tg.start_soon(deliver, first)
        await anyio.wait_all_tasks_blocked()
        assert worker.runs == 1 and first.answer is None  # the first send is held in its handler
        tg.start_soon(deliver, again)
        await anyio.wait_all_tasks_blocked()
        assert again.answer is None  # the resend waits for the first run, not a run of its own
        worker.hold.set()
        with anyio.fail_after(5):
            await first.answered.wait()
            await again.answered.wait()
        assert first.answer == again.answer and worker.runs == 1
        assert _ack(again).state.pause_mode == "keep"  # type: ignore[union-attr]
        tg.cancel_scope.cancel()


async def test_an_id_reused_for_another_payload_is_refused_and_nothing_runs():
    worker = Worker()
    async with anyio.create_task_group() as tg:
        _, send = await _served(tg, worker)
        await send(PauseWorker(mode="abort", epoch=0, command_id="c1"))
        reused = _ack(await send(PauseWorker(mode="wait", epoch=0, command_id="c1")))
        assert isinstance(reused, Nack) and reused.code == "INVALID_ARGUMENT"
        assert "first used for pause with another payload" in reused.message
        assert worker.runs == 1
        tg.cancel_scope.cancel()


async def test_a_handlers_bug_answers_internal_and_the_next_command_is_answered():
    worker = Worker()
    async with anyio.create_task_group() as tg:
        _, send = await _served(tg, worker)
        worker.fail = True
        broke = _ack(await send(PauseWorker(mode="abort", epoch=0, command_id="c1")))
        assert isinstance(broke, Nack) and broke.code == "INTERNAL" and "the engine broke" in broke.message
        worker.fail = False
        assert isinstance(_ack(await send(PauseWorker(mode="abort", epoch=0, command_id="c2"))), WorkerAck)
        tg.cancel_scope.cancel()


async def test_a_command_without_an_id_runs_every_time():
    worker = Worker()
    async with anyio.create_task_group() as tg:
        _, send = await _served(tg, worker)
        for _ in range(3):
            await send(PauseWorker(mode="abort", epoch=0, command_id=""))
        assert worker.runs == 3
        tg.cancel_scope.cancel()
