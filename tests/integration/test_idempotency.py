"""Idempotency that means it: a command id names one command (op and payload), a retry gets
the first answer, and that answer outlives a controller restart. The SDK retries through a
handover (no responders) with the same id. What a command writes to KV for it stays small: its
claim and its answer; the desired state only when it changed; the leadership lease on its
keeper's schedule, not once per command (the claim reached the store's quorum, and the lease's
expiry proves no other controller holds it)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid

import anyio
import msgspec
import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NoKeysError
from rlbus.schemas import (
    FIRST_SEND_HEADER,
    CommitDecision,
    FinishWeightUpdate,
    FleetAck,
    GetServerInfo,
    GetWeightVersion,
    KvKey,
    Nack,
    Pause,
    Resume,
    ServerInfo,
    StartWeightUpdate,
    Subjects,
    UpdateWeightVersion,
    VersionInfo,
    encode,
    op_of,
    reply_decoder,
)
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.controller.store import ReplyStore
from rlbus.services.endpoints import ReplyCache, StoredReply
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.runners.local import LocalFleet
from tests.fleet import controller_process, fleet_running
from tests.netfaults import Blackhole
from tests.waiting import eventually
from tests.weights_helpers import MODEL, VersionEvents, new_version

WORKERS = ("w0", "w1")


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, WORKERS) as running:
        yield running


async def _send(raw, prefix: str, command) -> object:
    op = type(command).__struct_config__.tag
    msg = await raw.request(Subjects(prefix).control(op), encode(command), timeout=10)
    return reply_decoder.decode(msg.data)


async def test_a_reused_id_for_another_op_is_refused_naming_the_conflict(fleet, raw, prefix):
    f, rl = fleet
    cid = uuid.uuid4().hex
    paused = await _send(raw, prefix, Pause(mode="abort", command_id=cid))
    assert isinstance(paused, FleetAck) and all(w.paused for w in paused.workers)
    try:
        refused = await _send(raw, prefix, Resume(command_id=cid))
        assert isinstance(refused, Nack) and refused.code == "INVALID_ARGUMENT", refused
        assert cid in refused.message and "pause" in refused.message
        assert await rl.is_paused(), "the refused resume must not have run, nor answered as the pause"
    finally:
        await rl.resume()


async def test_a_reused_id_with_another_payload_is_refused_and_changes_nothing(fleet, raw, prefix):
    f, rl = fleet
    cid = uuid.uuid4().hex
    first, second = new_version("first"), new_version("second")
    assert isinstance(await _send(raw, prefix, UpdateWeightVersion(new_version=first, command_id=cid)), FleetAck)
    refused = await _send(raw, prefix, UpdateWeightVersion(new_version=second, command_id=cid))
    assert isinstance(refused, Nack) and refused.code == "INVALID_ARGUMENT", refused
    assert await rl.get_weight_version() == first


async def _writes(raw, prefix: str, key: str, after: int) -> int:
    """How many times `key` of the state bucket was written after stream revision `after`."""
    kv = await raw.jetstream().key_value(Subjects(prefix).kv_bucket)

    async def history() -> list | None:
        try:
            return await kv.history(key)
        except NoKeysError:  # nats-py's watcher can mark its start done before the first entry is handled: read again
            return None

    entries = await eventually(history, timeout=5, what=f"{key}'s history (it has one: it was written)")
    return sum(1 for e in entries if (e.revision or 0) > after)


async def _revision(raw, prefix: str) -> int:
    return (await raw.jetstream().stream_info(Subjects(prefix).kv_stream)).state.last_seq


async def test_commands_in_quick_succession_renew_the_leadership_lease_only_on_its_keepers_schedule(fleet, raw, prefix):
    f, rl = fleet
    before = await _revision(raw, prefix)
    began = time.monotonic()
    for _ in range(5):
        await rl.pause("abort")
        await rl.resume()
    elapsed = time.monotonic() - began
    keeper = f.controller.opts.lease_s / 4  # the keeper renews this often, commands or not
    renewals = await _writes(raw, prefix, KvKey.LEADER, before)
    assert renewals <= elapsed / keeper + 1, f"{renewals} lease renewals for 10 commands in {elapsed:.2f}s"


async def test_a_second_pause_writes_no_desired_state(fleet, raw, prefix):
    f, rl = fleet
    await rl.pause("abort")
    try:
        before = await _revision(raw, prefix)
        again = await rl.pause("abort")
        assert all(w.paused for w in again.workers)
        assert await _writes(raw, prefix, KvKey.DESIRED, before) == 0, "an unchanged desired state was written"
    finally:
        await rl.resume()
    assert await _writes(raw, prefix, KvKey.DESIRED, before) == 1, "the resume's change was not written"


async def test_an_answers_write_reaches_nats_before_the_reply_does(fleet, raw, prefix, nats_server):
    """The answer is not awaited before the reply (its acknowledgement comes after), but its write
    leaves first on the controller's one connection: a subscriber sees the claim, then the answer,
    then the reply; and the store holds the answer the caller got."""
    f, rl = fleet
    cid = uuid.uuid4().hex
    key = f"$KV.{Subjects(prefix).replies_bucket}.{ReplyStore._key(cid)}"
    inbox = raw.new_inbox()
    seen: list[str] = []
    replied = anyio.Event()
    replies: list[bytes] = []

    async def on_any(msg) -> None:
        if msg.subject in (key, inbox):
            seen.append("reply" if msg.subject == inbox else "kv")
        if msg.subject == inbox:
            replies.append(msg.data)
            replied.set()

    sniffer = await nats.connect(nats_server.url)
    try:
        await sniffer.subscribe(">", cb=on_any)
        await sniffer.flush()
        await raw.subscribe(inbox)  # the reply needs a subscriber to be routed at all
        await raw.flush()
        await raw.publish(Subjects(prefix).control("pause"), encode(Pause(mode="abort", command_id=cid)), reply=inbox)
        with anyio.fail_after(10):
            await replied.wait()
        assert seen == ["kv", "kv", "reply"], f"the claim and the answer must reach NATS before the reply: {seen}"
        kv = await raw.jetstream().key_value(Subjects(prefix).replies_bucket)

        async def kept() -> StoredReply | None:  # stored once the server has written it (its ack)
            stored = msgspec.json.decode((await kv.get(ReplyStore._key(cid))).value, type=StoredReply)
            return stored if stored.answered else None

        stored = await eventually(kept, timeout=5, what="the answer stored")
        assert stored.reply == replies[0], "the store holds another answer than the reply"
    finally:
        await sniffer.close()
        await rl.resume()


async def test_a_retry_after_a_controller_restart_gets_the_first_answer_and_runs_once(fleet, raw, prefix, nats_server):
    f, rl = fleet
    version = new_version("once")
    command = UpdateWeightVersion(new_version=version, command_id=uuid.uuid4().hex)
    async with VersionEvents(rl) as events:
        first = await raw.request(Subjects(prefix).control("update_weight_version"), encode(command), timeout=10)
        assert await events.wait_for(1) == [version]
        old_epoch = f.controller.epoch
        await f.stop(f.controller)
        new = await f.start_controller(
            ControllerOptions(subjects=Subjects(prefix=prefix), command_timeout_s=10.0, liveness_timeout_s=1.5)
        )
        await f.wait_for_workers(WORKERS)
        assert new.epoch > old_epoch
        retry = await raw.request(Subjects(prefix).control("update_weight_version"), encode(command), timeout=10)
        assert retry.data == first.data, "the retry was run again instead of answered from the first run"
        later = new_version("later")
        await rl.update_weight_version(later)
        assert await events.wait_for(2) == [version, later], "the retried version was published twice"


async def test_the_sdk_retries_through_a_controller_handover_with_the_same_id(fleet, prefix, caplog):
    f, rl = fleet
    caplog.set_level("DEBUG", logger="rlbus.sdk.client")  # retries log at DEBUG until they last
    await rl.pause("abort")
    await f.stop(f.controller)  # nobody answers rl.control.* now
    resumed: list[FleetAck] = []

    async def resume() -> None:
        resumed.append(await rl.resume())

    async with anyio.create_task_group() as tg:
        tg.start_soon(resume)
        await eventually(
            lambda: "resume: no responders" in caplog.text,
            timeout=5,
            what="the client retrying while no controller answers",
        )
        assert not resumed
        await f.start_controller(
            ControllerOptions(subjects=Subjects(prefix=prefix), command_timeout_s=10.0, liveness_timeout_s=1.5)
        )
        await f.wait_for_workers(WORKERS)
    assert resumed and not any(w.paused for w in resumed[0].workers)
    assert not await rl.is_paused()


async def test_a_call_gives_up_with_unavailable_once_its_retry_window_passes(nats_server):
    async with await rlbus.RLClient.connect(
        nats_server.url, prefix="nobody-" + uuid.uuid4().hex[:6], timeout=10, retry_s=0.5
    ) as rl:
        with anyio.fail_after(5), pytest.raises(rlbus.Unavailable, match="no responders"):
            await rl.server_info()


async def test_a_finishs_closing_writes_reach_nats_before_its_reply_does(fleet, raw, prefix, nats_server):
    """The committed version's write, the session's record closed and the push lease freed are
    not awaited before the finish's reply (their acknowledgements come after it), but they leave
    ahead of it on the controller's one connection, and the store holds them. After the reply,
    once the version is acknowledged: rl.version says it, then the decision is marked done (a
    successor that finds it not done records the version again)."""
    f, rl = fleet
    subjects = Subjects(prefix)
    state = f"$KV.{subjects.kv_bucket}."
    closing = {
        state + KvKey.DECISION: "decision",
        state + KvKey.VERSION: "version",
        state + KvKey.SESSION: "session",
        state + KvKey.PUSH_LEASE: "lease",
        subjects.version: "event",
    }
    inbox = raw.new_inbox()
    seen: list[tuple[str, bytes]] = []
    replied = anyio.Event()

    async def on_any(msg) -> None:
        if msg.subject in closing:
            seen.append((closing[msg.subject], msg.data))
        elif msg.subject == inbox:
            seen.append(("reply", msg.data))
            replied.set()

    await rl.pause("abort")
    sniffer = await nats.connect(nats_server.url)
    try:
        started = await rl.start_weight_update()
        await sniffer.subscribe(">", cb=on_any)
        await sniffer.flush()
        await raw.subscribe(inbox)
        await raw.flush()
        version = new_version("closing")
        finish = FinishWeightUpdate(
            weight_version=version, session_id=started.session_id, trainer_id=rl.trainer_id, command_id=uuid.uuid4().hex
        )
        await raw.publish(subjects.control("finish_weight_update"), encode(finish), reply=inbox)
        with anyio.fail_after(10):
            await replied.wait()
        at = [what for what, _ in seen].index("reply")
        ack = reply_decoder.decode(seen[at][1])
        assert isinstance(ack, FleetAck) and ack.weight_version == version, ack
        before = [what for what, _ in seen[:at]]
        assert before[0] == "decision" and before.count("decision") == 1, f"the decision, before phase 2: {before}"
        assert {"version", "session", "lease"} <= set(before), (
            f"the closing writes must reach NATS before the reply: {before}"
        )
        await eventually(
            lambda: [w for w, _ in seen].count("decision") == 2, timeout=5, what="the decision marked done"
        )
        order = [what for what, _ in seen]
        assert order.index("version") < order.index("event") < len(order) - 1 - order[::-1].index("decision"), (
            f"the version written, then said on rl.version, then the decision marked done: {order}"
        )
        done = msgspec.json.decode([data for what, data in seen if what == "decision"][-1], type=CommitDecision)
        assert done.published and done.weight_version == version, "the decision marked done is not this commit's"
        kv = await raw.jetstream().key_value(subjects.kv_bucket)

        async def closed() -> bool:
            return (await kv.get(KvKey.SESSION)).value == b"null" and (await kv.get(KvKey.PUSH_LEASE)).value == b"null"

        await eventually(closed, timeout=5, what="the session closed and the lease freed in the store")
    finally:
        await sniffer.close()
        await rl.resume()


async def test_a_call_nobody_serves_ends_unavailable_when_its_deadline_cuts_the_last_try_short(nats_server):
    """Over a slow link (each answer 50 ms late) the back-off can leave the last try less time
    than a "no responders" takes to come back: that try times out at the deadline, and the call
    still says what every try learned (nobody serves it), not DEADLINE_EXCEEDED."""
    async with Blackhole(nats_server.port) as link:
        async with await rlbus.RLClient.connect(link.url, prefix="nobody-" + uuid.uuid4().hex[:6], timeout=10) as rl:
            link.delay_s = 0.05
            # tries end ~0.05, 0.15, 0.3, 0.55 s in; the next starts ~0.95 s in: these deadlines cut it short
            for timeout in (0.96, 0.97, 0.98, 0.99, 1.0):
                with anyio.fail_after(5), pytest.raises(rlbus.Unavailable, match="no responders"):
                    await rl.call(GetServerInfo(), ServerInfo, timeout=timeout)


async def test_an_answer_slower_than_one_attempt_reaches_the_call_after_it_sent_again(nats_server):
    """The controller answers each send on the reply subject it came with, and a resend that
    waited behind the first hears nothing new (the reply cache): the first send's answer,
    later than one attempt (a store riding out a node loss for 15 s against 5 s attempts),
    must still reach the call, which keeps one reply subject for all its sends."""
    prefix = "slow-" + uuid.uuid4().hex[:6]
    responder = await nats.connect(nats_server.url)
    sends: list[str] = []

    async def answer_the_first_send_late(msg) -> None:
        sends.append(msg.reply)
        if len(sends) == 1:  # answered 0.5 s late (a stand-in for the store's patience); resends never
            loop = asyncio.get_running_loop()
            loop.call_later(0.5, lambda: loop.create_task(msg.respond(encode(VersionInfo(version="slow", seq=7)))))

    await responder.subscribe(Subjects(prefix=prefix).control(op_of(GetWeightVersion)), cb=answer_the_first_send_late)
    await responder.flush()
    try:
        async with await rlbus.RLClient.connect(nats_server.url, prefix=prefix, timeout=3) as rl:
            rl.attempt_s = 0.2
            with anyio.fail_after(3):
                info = await rl.call(GetWeightVersion(), VersionInfo)
            assert (info.version, info.seq) == ("slow", 7)
            assert len(sends) >= 2 and len(set(sends)) == 1, "every send of the call names one reply subject"
    finally:
        await responder.close()


async def test_a_claim_sent_again_after_its_acknowledgement_was_lost_runs_the_command_once(nats_server, monkeypatch):
    """A claim's write lands but its acknowledgement does not arrive in time (an event loop
    stalled by a model's work times it out): the store sends it again, finds the id taken, and
    must know the record for its own, not a dead run's: the command runs, once."""
    nc = await nats.connect(nats_server.url)
    try:
        replies = await ReplyStore.open(nc, "lostack_" + uuid.uuid4().hex[:8], ttl_s=60)
        real = replies.store.kv.create
        lost: list[int] = []

        async def create_then_lose_the_ack(key, value, **kw):
            revision = await real(key, value, **kw)
            if not lost:
                lost.append(revision)
                raise NatsTimeout
            return revision

        monkeypatch.setattr(replies.store.kv, "create", create_then_lose_the_ack)
        ran: list[str] = []

        async def work() -> bytes:
            ran.append("ran")
            return b"ok"

        cache = ReplyCache(durable=replies)
        assert await cache.run("c1", "pause:x", work, durable=True) == b"ok"
        await cache.settle("c1")
        assert lost and ran == ["ran"]
        assert await ReplyCache(durable=replies).run("c1", "pause:x", work, durable=True) == b"ok"  # a new process
        assert ran == ["ran"], "run twice"
    finally:
        await nc.close()


# ---- an answer is durable before it is sent (real controller processes, SIGKILL) ---------------

KILL_ROUNDS = 5


def _controller_process(url: str, prefix: str) -> subprocess.Popen:
    return controller_process(url, prefix, "--lease", "0.5", "--liveness-timeout", "1.5", "--command-timeout", "5")


@pytest.fixture
async def process_controllers(nats_server):
    """Two in-process workers and controllers as real processes (the test starts them)."""
    p = "k" + uuid.uuid4().hex[:8]
    fleet = LocalFleet(nats_server.url)
    procs: list[subprocess.Popen] = []
    rl = await rlbus.RLClient.connect(nats_server.url, prefix=p, timeout=20.0)
    try:
        for wid in WORKERS:
            await fleet.start_worker(
                ReferenceEngine(MODEL), WorkerOptions(worker_id=wid, subjects=Subjects(prefix=p), heartbeat_s=0.2)
            )
        yield rl, p, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            await anyio.to_thread.run_sync(proc.wait, 10)
        await rl.close()
        await fleet.close()


async def _leads_with_every_worker(rl: rlbus.RLClient, proc: subprocess.Popen) -> bool:
    try:
        info = await rl.call(GetServerInfo(), ServerInfo, timeout=1.0)
    except rlbus.RLBusError:
        return False
    return proc.poll() is None and len(info.workers) == len(WORKERS)


async def test_a_controller_killed_right_after_it_answered_never_runs_the_retried_command_again(
    process_controllers, raw, nats_server
):
    rl, p, procs = process_controllers
    subject = Subjects(prefix=p).control("update_weight_version")
    async with VersionEvents(rl) as events:
        published: list[str] = []
        for _ in range(KILL_ROUNDS):
            procs.append(_controller_process(nats_server.url, p))
            await eventually(lambda: _leads_with_every_worker(rl, procs[-1]), timeout=30, what="a controller leading")
            version = new_version("kill")
            command = UpdateWeightVersion(new_version=version, command_id=uuid.uuid4().hex)
            first = await raw.request(subject, encode(command), timeout=10)
            procs[-1].send_signal(signal.SIGKILL)  # right after it answered: its answer must be kept already
            published.append(version)
            assert isinstance(reply_decoder.decode(first.data), FleetAck)
            procs.append(_controller_process(nats_server.url, p))
            await eventually(lambda: _leads_with_every_worker(rl, procs[-1]), timeout=30, what="the next controller")
            retry = await raw.request(subject, encode(command), timeout=10)
            assert retry.data == first.data, "the retry was run again instead of answered from the first run"
            procs[-1].send_signal(signal.SIGKILL)  # the next round starts from a dead leader too
        procs.append(_controller_process(nats_server.url, p))
        await eventually(lambda: _leads_with_every_worker(rl, procs[-1]), timeout=30, what="a last controller")
        assert await rl.get_weight_version() == published[-1]
        await events.wait_for(len(published))
        assert [v.version for v in events.seen] == published, "a retried command published its version again"
        assert len({v.seq for v in events.seen}) == len(published)


async def test_a_controller_killed_right_after_a_finish_answered_leaves_its_session_closed_and_its_lease_free(
    process_controllers, raw, nats_server
):
    """The finish's closing writes are acknowledged after its reply: killed right after it, the
    controller has still left them with the server, so the next controller finds the commit
    recorded and lets another trainer start at once (a lease left held would refuse it for
    the lease's whole period)."""
    rl, p, procs = process_controllers
    subjects = Subjects(prefix=p)
    async with VersionEvents(rl) as events:
        published: list[str] = []
        for k in range(KILL_ROUNDS):
            procs.append(_controller_process(nats_server.url, p))
            await eventually(lambda: _leads_with_every_worker(rl, procs[-1]), timeout=30, what="a controller leading")
            await rl.pause("abort")  # workers that update in place start paused
            trainer = f"trainer-{k}"  # another trainer each round: the last one's lease must be free
            start = StartWeightUpdate(trainer_id=trainer, command_id=uuid.uuid4().hex)
            started = reply_decoder.decode(
                (await raw.request(subjects.control("start_weight_update"), encode(start), timeout=10)).data
            )
            assert isinstance(started, FleetAck) and started.session_id, started
            version = new_version("killed")
            finish = FinishWeightUpdate(
                weight_version=version, session_id=started.session_id, trainer_id=trainer, command_id=uuid.uuid4().hex
            )
            first = await raw.request(subjects.control("finish_weight_update"), encode(finish), timeout=10)
            procs[-1].send_signal(signal.SIGKILL)  # right after it answered
            published.append(version)
            committed = reply_decoder.decode(first.data)
            assert isinstance(committed, FleetAck) and committed.weight_version == version, committed
        procs.append(_controller_process(nats_server.url, p))
        await eventually(lambda: _leads_with_every_worker(rl, procs[-1]), timeout=30, what="a last controller")
        assert await rl.get_weight_version() == published[-1]
        await events.wait_for(len(published))
        assert [v.version for v in events.seen] == published, "a commit was published twice or lost"
        kv = await raw.jetstream().key_value(subjects.kv_bucket)
        decision = msgspec.json.decode((await kv.get(KvKey.DECISION)).value, type=CommitDecision)
        assert decision.published and decision.weight_version == published[-1]
        assert (await kv.get(KvKey.SESSION)).value == b"null" and (await kv.get(KvKey.PUSH_LEASE)).value == b"null"
        await rl.resume()


async def test_only_the_first_send_of_a_command_whose_id_the_sdk_made_says_it_is_the_first(nats_server):
    """FIRST_SEND_HEADER lets the controller land a pause's claim beside its fan-out: no earlier
    run of the id can exist. A resend never says it, nor any send of a command whose id the
    caller set (it may be a retry of a call that gave up)."""
    prefix = "first-" + uuid.uuid4().hex[:6]
    responder = await nats.connect(nats_server.url)
    sends: list[tuple[str, str | None]] = []

    async def never_answer(msg) -> None:
        command = msgspec.json.decode(msg.data)
        sends.append((command["command_id"], (msg.headers or {}).get(FIRST_SEND_HEADER)))

    await responder.subscribe(Subjects(prefix=prefix).control(op_of(Pause)), cb=never_answer)
    await responder.flush()
    try:
        async with await rlbus.RLClient.connect(nats_server.url, prefix=prefix, timeout=3) as rl:
            rl.attempt_s = 0.1
            for command in (Pause(mode="keep"), Pause(mode="keep", command_id=uuid.uuid4().hex)):
                sends.clear()
                with pytest.raises(rlbus.DeadlineExceeded):
                    await rl.call(command, FleetAck, timeout=0.5)
                assert len(sends) >= 2 and len({cid for cid, _ in sends}) == 1, sends
                said = [first for _, first in sends]
                assert said == (["1"] if not command.command_id else [None]) + [None] * (len(sends) - 1), said
    finally:
        await responder.close()
