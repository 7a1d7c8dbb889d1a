"""NATS faults: the server restarted (idle, while paused, under a version watcher) and a
connection that goes silent (a blackholed link) — on a nats-server of this module's own,
since restarting the session's server would break every other module's fleet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import anyio
import pytest
from rlbus.schemas import (
    RESEND_TO_HEADER,
    GenerateRequest,
    GetServerInfo,
    ServerInfo,
    Subjects,
    VersionInfo,
    encode,
    generate_reply_decoder,
)
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.bus.replies import relinks_of
from rlbus.runners.local import LocalFleet
from rlbus.runners.natsserver import NatsServer
from rlbus.sdk.client import RLClient
from tests.netfaults import Blackhole
from tests.waiting import eventually
from tests.weights_helpers import (
    MODEL,
    assert_holds,
    first_watched_version,
    new_version,
    settle,
    trained,
)

WORKERS = ["w0", "w1"]
LIVENESS_S = 1.0


@pytest.fixture(scope="module")
def server():
    """This module's own server: the tests restart it (same port, same JetStream store)."""
    with NatsServer() as s:
        yield s


def _worker_options(prefix: str, worker_id: str) -> WorkerOptions:
    return WorkerOptions(
        worker_id=worker_id, subjects=Subjects(prefix=prefix), heartbeat_s=0.2, weight_transfer_backend="shm"
    )


@pytest.fixture(scope="module")
async def fleet(server, prefix):
    f = LocalFleet(server.url)
    await f.start_controller(
        ControllerOptions(
            subjects=Subjects(prefix=prefix), command_timeout_s=2.5, liveness_timeout_s=LIVENESS_S, lease_s=1.0
        )
    )
    for wid in WORKERS:
        await f.start_worker(ReferenceEngine(MODEL), _worker_options(prefix, wid))
    await f.wait_for_workers(WORKERS)
    rl = await RLClient.connect(server.url, prefix=prefix, timeout=20.0)
    await rl.init_weight_transfer(timeout_s=5)
    yield f, rl
    await rl.close()
    await f.close()


@pytest.fixture(autouse=True)
async def settled(fleet):
    yield
    await settle(fleet[1])


async def _restart(server: NatsServer) -> None:
    # On the loop's own (main) thread, on purpose: rlbus.runners.children sets PR_SET_PDEATHSIG, which
    # fires when the *thread* that spawned the child exits, and anyio retires idle worker
    # threads after 10 s, taking a server restarted from one with them.
    server.restart()


async def _answers_with(rl: RLClient, workers: Sequence[str]) -> ServerInfo | None:
    """server_info, once the controller answers it and lists exactly `workers`."""
    try:
        info = await rl.call(GetServerInfo(), ServerInfo, timeout=1.0)
    except Exception:
        return None
    return info if sorted(w.worker_id for w in info.workers) == sorted(workers) else None


async def _recovered(rl: RLClient, workers: Sequence[str] = WORKERS) -> ServerInfo:
    return await eventually(
        lambda: _answers_with(rl, workers),
        timeout=20,
        interval=0.05,
        what=f"the controller answering with {list(workers)} after the restart",
    )


# ---- restarts ----------------------------------------------------------------------------------


async def test_services_reconnect_after_a_restart_while_idle_and_keep_the_version(fleet, server):
    f, rl = fleet
    version, named = new_version("idle"), trained(1)
    await rl.push_weights(named, version)
    epoch = (await rl.server_info()).epoch

    await _restart(server)
    info = await _recovered(rl)

    assert info.weight_version == version and info.session_id is None
    assert info.epoch == epoch, "a reconnect is not a new controller"
    assert await rl.get_weight_version() == version
    assert await first_watched_version(rl) == version
    for wid in f.workers:
        assert_holds(f, wid, named)
    after = new_version("idle")
    ack = await rl.push_weights(trained(2), after)
    assert ack.weight_version == after and sorted(w.worker_id for w in ack.workers) == WORKERS


async def test_a_paused_fleet_stays_paused_across_a_restart_and_resumes(fleet, server):
    f, rl = fleet
    version = (await rl.server_info()).weight_version
    await rl.pause("abort")
    assert await rl.is_paused()

    await _restart(server)
    await _recovered(rl)

    assert await rl.is_paused(), "a restart of NATS must not resume the fleet"
    assert all(w.state().paused for w in f.workers.values())
    await rl.resume()
    assert not await rl.is_paused()
    assert (await rl.generate([1, 2, 3], 4)).weight_version == version
    assert await rl.get_weight_version() == version


async def test_a_version_watcher_disconnected_by_a_restart_still_ends_on_the_current_version(fleet, server):
    _, rl = fleet
    current = (await rl.server_info()).weight_version
    seen: list[VersionInfo] = []

    async def watch() -> None:
        async for v in rl.watch_versions():
            seen.append(v)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await eventually(lambda: seen, timeout=10, what="the watcher's first version")
        assert seen[0].version == current

        await _restart(server)
        await _recovered(rl)
        after = new_version("v-after")
        await rl.push_weights(trained(3), after)

        # the watcher is an ordered consumer with a 1 s idle heartbeat: it notices the lost
        # consumer within a few seconds and resumes after the last version it delivered
        await eventually(
            lambda: seen[-1].version == after,
            timeout=15,
            interval=0.05,
            what=f"the watcher reaching {after} (saw {[v.version for v in seen]})",
        )
        tg.cancel_scope.cancel()
    # re-deliveries of earlier versions are allowed, but never a version after the current one
    assert [v.version for v in seen if v.version not in (current, after)] == []


async def test_a_version_watcher_started_while_the_server_is_down_yields_once_it_is_back(fleet, server, caplog):
    _, rl = fleet
    current = (await rl.server_info()).weight_version
    server.stop(keep_store=True)
    await eventually(lambda: rl.nc.is_reconnecting, timeout=10, what="the client noticing the server is gone")
    watcher = rl.watch_versions()
    caplog.set_level("INFO", logger="rlbus.sdk.versions")
    first = asyncio.ensure_future(anext(watcher))
    try:
        await eventually(
            lambda: "retrying" in caplog.text, timeout=15, what="the watcher's setup failing while the server is down"
        )
        assert not first.done()
        server.start_again()  # on the loop thread, as _restart explains
        assert (await asyncio.wait_for(first, 20)).version == current
        await _recovered(rl)
        after = new_version("v-back")
        await rl.push_weights(trained(4), after)
        assert (await asyncio.wait_for(anext(watcher), 15)).version == after
    finally:
        first.cancel()
        await watcher.aclose()


# ---- a blackholed connection -------------------------------------------------------------------


async def test_a_generate_reply_lost_while_the_callers_link_was_down_is_asked_again_of_the_worker_that_took_it(
    fleet, server, prefix
):
    """A worker's reply that reaches the caller's connection while its link is silent is lost
    (NATS keeps nothing for a subscriber that is gone). After the reconnect the SDK sends the
    request again under its request id, and the call is answered: it does not wait out its
    deadline (seen in the vLLM tests on a loaded host: nats-server answered no PING for 5-10 s,
    every client reconnected, and two replies were gone). The send again goes to the worker
    that took the request, which said so as it took it (RESEND_TO_HEADER), not through the
    queue group, where another worker would run it a second time."""
    f, rl = fleet
    assert server.port is not None
    subjects = Subjects(prefix=prefix)
    sends: list[str] = []

    async def seen(msg) -> None:
        sends.append(msg.subject)

    spies = [await rl.nc.subscribe(s, cb=seen) for s in (subjects.generate, subjects.generate_at("*"))]
    told = asyncio.Event()
    async with Blackhole(server.port) as hole:
        hole.tripwire = (RESEND_TO_HEADER.encode(), told.set)  # the word of where to send again reached it
        far = await RLClient.connect(hole.url, prefix=prefix, timeout=20.0)  # only its link goes through the proxy
        try:
            await rl.pause("keep")  # new requests wait for the resume
            try:
                call = asyncio.create_task(far.generate([1, 2, 3], 4, timeout=20.0))
                await eventually(
                    lambda: sum(w.engine.status().waiting for w in f.workers.values()) == 1,
                    what="the request held by the pause",
                )
                took = next(wid for wid, w in f.workers.items() if w.engine.status().waiting == 1)
                await asyncio.wait_for(told.wait(), 10)
                hole.holed = True  # the caller's link goes silent
            finally:
                await rl.resume()
            await eventually(lambda: b"generate_reply" in hole.swallowed, timeout=10, what="the reply lost on the link")
            hole.holed = False
            hole.cut()  # the link resets: the SDK reconnects through the proxy
            reply = await asyncio.wait_for(call, 10)
        finally:
            await far.close()
            for spy in spies:
                await spy.unsubscribe()
    assert len(reply.tokens) == 4 and reply.worker_id == took, "answered by the run of the worker that took it"
    assert sends[0] == subjects.generate and set(sends[1:]) == {subjects.generate_at(took)}, sends
    again = await rl.generate([1, 2, 3], 4)
    assert (reply.tokens, reply.weight_version) == (again.tokens, again.weight_version), "as a call that lost nothing"
    plain = await rl.nc.request(
        subjects.generate,
        encode(GenerateRequest(prompt_tokens=[1, 2, 3], max_tokens=4, request_id="plain")),
        timeout=20,
    )
    assert generate_reply_decoder.decode(plain.data).tokens == again.tokens, "a plain request gets the answer alone"


async def test_a_generate_reply_lost_with_no_reconnect_is_asked_again_of_the_worker_after_a_gap_not_the_deadline(
    fleet, server, prefix
):
    """A reply can be lost with nothing for the caller's link to notice (on the worker's link,
    closed by the server while it was silent; here, swallowed on the caller's link for a moment
    too short to drop it). A call the worker told where to send again asks there after a gap
    (RLClient.reask_s, doubled each time) while no answer came: a run under way answers with
    the same word, not a second reply; a finished one with its reply. So the call ends in
    seconds, not at its deadline, with no reconnect and one run."""
    f, rl = fleet
    assert server.port is not None
    subjects = Subjects(prefix=prefix)
    sends: list[str] = []
    answers: list = []

    async def seen(msg) -> None:
        sends.append(msg.subject)

    async def answered(msg) -> None:
        answers.append(msg)

    spies = [await rl.nc.subscribe(s, cb=seen) for s in (subjects.generate, subjects.generate_at("*"))]
    told = asyncio.Event()
    async with Blackhole(server.port) as hole:
        hole.tripwire = (RESEND_TO_HEADER.encode(), told.set)
        far = await RLClient.connect(hole.url, prefix=prefix, timeout=30.0)
        far.reask_s = 0.5
        relinks = relinks_of(far.nc).count
        try:
            await rl.pause("keep")  # new requests wait for the resume
            try:
                call = asyncio.create_task(far.generate([1, 2, 3], 4, timeout=30.0))
                await asyncio.wait_for(told.wait(), 10)
                spies.append(await rl.nc.subscribe(far._replies._prefix + "*", cb=answered))
                took = next(wid for wid, w in f.workers.items() if w.engine.status().waiting == 1)
                words = lambda: [m for m in answers if not m.data and RESEND_TO_HEADER in (m.headers or {})]  # noqa: E731
                # asked again while the run is held: told the run is there, no second run
                await eventually(lambda: len(words()) >= 1, timeout=10, what="a word for an ask while it runs")
                assert sends[0] == subjects.generate and subjects.generate_at(took) in sends[1:], sends
                hole.holed = True  # the reply will be swallowed; the link stays up
            finally:
                await rl.resume()
            await eventually(lambda: b"generate_reply" in hole.swallowed, timeout=10, what="the reply lost on the link")
            hole.holed = False  # nothing tells the caller: no reconnect, no resend of that kind
            reply = await asyncio.wait_for(call, 15)
            assert relinks_of(far.nc).count == relinks, "answered without a reconnect"
        finally:
            await far.close()
            for spy in spies:
                await spy.unsubscribe()
    assert len(reply.tokens) == 4 and reply.worker_id == took, "answered by the run of the worker that took it"
    assert set(sends[1:]) == {subjects.generate_at(took)}, sends
    replies = [m for m in answers if m.data]
    assert len(replies) == 2, "the lost reply and the same reply once more: one run, no reply a word answered"
    assert replies[0].data == replies[1].data


async def test_a_blackholed_worker_is_detected_within_seconds_and_rejoins_when_the_link_returns(fleet, server, prefix):
    f, rl = fleet
    assert f.controller is not None and server.port is not None
    async with Blackhole(server.port) as hole:
        far = LocalFleet(hole.url)  # only this worker's connection goes through the proxy
        worker = await far.start_worker(ReferenceEngine(MODEL), _worker_options(prefix, "far"))
        try:
            await f.wait_for_workers(["far"])
            await _recovered(rl, [*WORKERS, "far"])

            hole.holed = True
            holed = time.monotonic()
            # the controller: missed heartbeats drop it after the liveness timeout
            await eventually(
                lambda: "far" not in f.controller.registry,
                timeout=LIVENESS_S + 2,
                what="the controller dropping the silent worker",
            )
            # the worker itself: unanswered pings (every 2 s, 2 outstanding) mark the link dead
            await eventually(
                lambda: not worker.nc.is_connected,
                timeout=9,
                interval=0.05,
                what="the worker's connection noticing the silent link",
            )
            assert time.monotonic() - holed < 9
            assert sorted(w.worker_id for w in (await rl.pause()).workers) == WORKERS  # the rest still answers
            await rl.resume()

            hole.holed = False
            await eventually(lambda: worker.nc.is_connected, timeout=15, interval=0.05, what="the worker reconnecting")
            await _recovered(rl, [*WORKERS, "far"])
        finally:
            await far.kill(worker)
    await eventually(lambda: "far" not in f.controller.registry, timeout=LIVENESS_S + 2, what="far gone again")


async def test_a_worker_that_stops_serving_on_a_dead_link_survives_and_leaves_no_generate_service(
    fleet, server, prefix
):
    """A worker that finds itself behind while its link is silent (thawed from a freeze, a dead
    route) stops its generate service: micro's stop() cannot finish its round trip there. The
    worker goes on, and nothing of the stopped service is subscribed again on reconnect."""
    f, rl = fleet
    assert server.port is not None
    async with Blackhole(server.port) as hole:
        far = LocalFleet(hole.url)
        worker = await far.start_worker(ReferenceEngine(MODEL), _worker_options(prefix, "dead-link"))
        try:
            await f.wait_for_workers(["dead-link"])
            await eventually(lambda: worker._generate_service is not None, timeout=10, what="dead-link serving")
            hole.holed = True
            with anyio.fail_after(5):  # micro's own stop() would raise FlushTimeoutError after its 10 s flush
                await worker._withhold(True)
            assert worker._generate_service is None and worker.book.withheld
            left = [s.subject for s in worker.nc._subs.values() if "rlbus-generate" in s.subject]
            assert left == [], f"stopped but still subscribed (again on reconnect): {left}"
            hole.holed = False
            await eventually(lambda: worker.nc.is_connected, timeout=15, interval=0.05, what="reconnected")
            await _recovered(rl, [*WORKERS, "dead-link"])  # back in the fleet, serving again
        finally:
            await far.kill(worker)
    await eventually(lambda: "dead-link" not in f.controller.registry, timeout=LIVENESS_S + 2, what="gone")
