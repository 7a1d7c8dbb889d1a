"""The reply cache sends a state-changing command's answer to the store before it returns it (the
write goes out ahead of the reply; its acknowledgement is awaited after), and a command that started
but never answered (its process died) is not run twice on retry: answered from the state its run
left where its route can say, else refused; no server."""

from __future__ import annotations

import anyio
import pytest
from rlbus.schemas import Nack, reply_decoder
from rlbus.schemas.errors import Unavailable
from rlbus.services.endpoints import ClaimFound, ClaimRefused, ReplyCache, StoredReply, after_reply, claimed


class DictReplies:
    """A DurableReplies in a dict: a put is recorded as sent at once; its acknowledgement waits
    for `gate` (a slow store)."""

    def __init__(self) -> None:
        self.kept: dict[str, StoredReply] = {}
        self.sent: list[str] = []
        self.gate = anyio.Event()

    async def claim(self, command_id: str, running: StoredReply) -> StoredReply | None:
        if command_id in self.kept:
            return self.kept[command_id]
        self.kept[command_id] = running
        return None

    async def put(self, command_id: str, stored: StoredReply):
        self.sent.append(command_id)

        async def acked() -> None:
            await self.gate.wait()
            self.kept[command_id] = stored

        return acked


async def test_an_answer_is_sent_to_the_store_before_it_is_returned_and_settled_after():
    store = DictReplies()
    cache = ReplyCache(durable=store)
    answered: list[bytes] = []
    settled = anyio.Event()

    async def run() -> None:
        answered.append(await cache.run("c1", "pause:x", lambda: _answer(b"ok"), durable=True))
        await cache.settle("c1")
        settled.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        assert store.sent == ["c1"], "the answer was returned before its write went to the store"
        assert answered == [b"ok"], "the answer waited for the store's acknowledgement"
        assert not store.kept["c1"].answered and not settled.is_set(), "settle() did not wait for the ack"
        store.gate.set()
    assert store.kept["c1"] == StoredReply("pause:x", b"ok")
    await cache.settle("c1")  # settled once: a second settle has nothing to wait for


async def test_a_handlers_write_sent_ahead_of_the_reply_is_acknowledged_after_it_with_the_answer():
    store = DictReplies()
    cache = ReplyCache(durable=store)
    sent: list[str] = []
    acks = anyio.Event()
    answered: list[bytes] = []
    settled = anyio.Event()

    async def acked() -> None:
        await acks.wait()
        sent.append("acked")

    async def work() -> bytes:  # e.g. a finish: the session's record closed, sent ahead of the reply
        sent.append("session closed")
        await after_reply(acked, "the session's record")
        return b"committed"

    async def run() -> None:
        answered.append(await cache.run("c1", "finish_weight_update:x", work, durable=True))
        await cache.settle("c1")
        settled.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        assert sent == ["session closed"] and store.sent == ["c1"], "the writes were not both sent ahead of the reply"
        assert answered == [b"committed"], "the reply waited for the handler's write to be acknowledged"
        assert not settled.is_set(), "settle() did not wait for the handler's write"
        store.gate.set()
        await anyio.wait_all_tasks_blocked()
        assert not settled.is_set(), "settle() returned before the handler's write was acknowledged"
        acks.set()
    assert sent == ["session closed", "acked"] and store.kept["c1"].answered


async def test_a_write_sent_ahead_outside_a_command_is_awaited_at_once_and_a_refusal_raises():
    async def refused() -> None:
        raise ConnectionError("no quorum")

    with pytest.raises(ConnectionError, match="no quorum"):
        await after_reply(refused, "the decision marked done")  # a takeover records with no reply to wait behind


async def test_a_refused_write_sent_ahead_is_logged_and_the_answer_stands(caplog):
    caplog.set_level("WARNING", logger="rlbus.services")  # earlier tests in the suite leave the root logger at ERROR
    cache = ReplyCache(durable=DictReplies())

    async def refused() -> None:
        raise ConnectionError("no quorum")

    async def work() -> bytes:
        await after_reply(refused, "the released push lease")
        return b"committed"

    cache.durable.gate.set()  # type: ignore[union-attr]
    assert await cache.run("c1", "finish_weight_update:x", work, durable=True) == b"committed"
    await cache.settle("c1")
    assert "the released push lease was not kept in the state store: no quorum" in caplog.text


async def test_a_command_that_started_and_never_answered_is_refused_on_retry_not_run_again():
    store = DictReplies()
    store.kept["c1"] = StoredReply("update_weight_version:x", b"", answered=False)  # a process died mid-run
    ran: list[bool] = []

    async def work() -> bytes:
        ran.append(True)
        return b"ran"

    reply = reply_decoder.decode(
        await ReplyCache(durable=store).run("c1", "update_weight_version:x", work, durable=True)
    )
    assert not ran
    assert isinstance(reply, Nack) and reply.code == "ABORTED" and "not run twice" in reply.message


async def test_a_command_that_never_answered_is_answered_from_what_its_run_left_when_the_route_can_say():
    store = DictReplies()
    store.kept["c1"] = StoredReply("finish_weight_update:x", b"", answered=False)  # died after its decision

    async def work() -> bytes:
        raise AssertionError("run twice")

    async def decided() -> bytes | None:
        return b"the decided commit's ack"

    async def nothing() -> bytes | None:
        return None

    cache = ReplyCache(durable=store)
    assert (
        await cache.run("c1", "finish_weight_update:x", work, durable=True, recover=decided)
        == b"the decided commit's ack"
    )
    store.kept["c2"] = StoredReply("finish_weight_update:y", b"", answered=False)
    reply = reply_decoder.decode(await cache.run("c2", "finish_weight_update:y", work, durable=True, recover=nothing))
    assert isinstance(reply, Nack) and reply.code == "ABORTED"


class NoQuorumReplies(DictReplies):
    """A store without quorum: each claim waits for `gate`, then is refused UNAVAILABLE."""

    def __init__(self) -> None:
        super().__init__()
        self.claims = 0

    async def claim(self, command_id: str, running: StoredReply) -> StoredReply | None:
        self.claims += 1
        await self.gate.wait()
        raise Unavailable("the state store has no quorum")


async def test_a_resend_that_waited_on_a_claim_the_store_refused_hears_that_refusal_not_a_second_wait():
    store = NoQuorumReplies()
    cache = ReplyCache(durable=store)
    refused: list[str] = []

    async def send() -> None:
        try:
            await cache.run("c1", "pause:x", lambda: _answer(b"ok"), durable=True)
        except Unavailable as e:
            refused.append(e.message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)  # the first send: its claim waits on the store
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(send)  # the SDK's resend, same id, while the first still runs
        await anyio.wait_all_tasks_blocked()
        assert store.claims == 1
        store.gate.set()
    assert refused == ["the state store has no quorum"] * 2
    assert store.claims == 1, "the resend started the store's whole patience over"
    await send()  # a send after the refusal tries the store again: quorum may be back
    assert store.claims == 2 and len(refused) == 3


class GatedReplies(DictReplies):
    """A store whose claims land when `landed` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.landed = anyio.Event()

    async def claim(self, command_id: str, running: StoredReply) -> StoredReply | None:
        await self.landed.wait()
        return await super().claim(command_id, running)


async def test_a_claim_beside_its_handler_lands_while_it_runs_and_the_handler_waits_for_it_before_it_decides():
    store = GatedReplies()
    cache = ReplyCache(durable=store)
    steps: list[str] = []

    async def work() -> bytes:
        steps.append("checked")  # what it may do before the claim lands: only what it can undo
        await claimed()
        steps.append("decided")
        return b"committed"

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: cache.run("c1", "finish:x", work, durable=True, beside=True))
        await anyio.wait_all_tasks_blocked()
        assert steps == ["checked"], "the handler did not start before its claim landed, or decided before it"
        store.landed.set()
    assert steps == ["checked", "decided"]
    store.gate.set()
    await cache.settle("c1")
    assert store.kept["c1"] == StoredReply("finish:x", b"committed")


async def test_a_claim_beside_refused_by_the_store_answers_its_refusal_recorded_nowhere():
    store = NoQuorumReplies()
    store.gate.set()
    cache = ReplyCache(durable=store)
    undone: list[str] = []

    async def work() -> bytes:
        try:
            await claimed()
        except ClaimRefused:
            undone.append("reopened")
            raise
        return b"committed"

    with pytest.raises(Unavailable, match="no quorum"):
        await cache.run("c1", "finish:x", work, durable=True, beside=True)
    assert undone == ["reopened"] and "c1" not in store.kept
    with pytest.raises(Unavailable):  # not recorded: a send after it tries the store again
        await cache.run("c1", "finish:x", work, durable=True, beside=True)
    assert store.claims == 2


async def test_a_claim_beside_that_finds_an_earlier_run_answers_from_it_not_from_the_handler():
    store = DictReplies()
    store.kept["c1"] = StoredReply("finish:x", b"", answered=False, claim="a dead run")
    cache = ReplyCache(durable=store)
    gave_way: list[str] = []

    async def work() -> bytes:
        try:
            await claimed()
        except ClaimFound:
            gave_way.append("reopened")
            raise
        return b"ran twice"

    async def recover() -> bytes:
        return b"what the earlier run left"

    got = await cache.run("c1", "finish:x", work, durable=True, beside=True, recover=recover)
    assert got == b"what the earlier run left" and gave_way == ["reopened"]
    # a handler that refused before it reached the claim gives way to the earlier run too
    cache = ReplyCache(durable=store)
    got = await cache.run(
        "c1", "finish:x", lambda: _answer(b"refused early"), durable=True, beside=True, recover=recover
    )
    assert got == b"what the earlier run left"


async def test_a_resend_that_waited_on_a_gate_that_refused_the_command_hears_that_refusal_and_never_runs_it():
    cache = ReplyCache(durable=DictReplies())
    opened = anyio.Event()
    gates: list[str] = []
    ran: list[str] = []
    refused: list[str] = []

    async def gate() -> None:  # the lease's renewal, riding out a store without quorum
        gates.append("asked")
        await opened.wait()
        if len(gates) == 1:
            raise Unavailable("the state store has no quorum")

    async def work() -> bytes:
        ran.append("ran")
        return b"ok"

    async def send() -> None:
        try:
            await cache.run("c1", "pause:x", work, durable=True, gate=gate)
        except Unavailable as e:
            refused.append(e.message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(send)  # the resend: it must not run the command once quorum is back
        await anyio.wait_all_tasks_blocked()
        opened.set()
    assert refused == ["the state store has no quorum"] * 2 and gates == ["asked"] and ran == []


async def test_a_read_is_neither_marked_nor_kept():
    store = DictReplies()
    assert await ReplyCache(durable=store).run("c1", "is_paused:x", lambda: _answer(b"yes")) == b"yes"
    assert not store.kept


async def _answer(data: bytes) -> bytes:
    return data
