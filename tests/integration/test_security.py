"""Least privilege on a real nats-server configured by `write_config`: every service runs with
its own role's credentials, and each role is refused what it must not do — loudly, at once,
and without changing the fleet.

One server and one fleet (controller + 2 gloo workers, prefix `rl`) serve the module.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest
from rlbus.schemas import PauseWorker, Subjects, WorkerAck, WorkerGone, WorkerState, encode
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

import rlbus
from rlbus.bus.connection import NatsAuth, connect, denials_of, drain, request
from rlbus.runners.local import LocalFleet
from rlbus.runners.natsconfig import identities, read_env_file, write_config
from rlbus.runners.natsserver import NatsServer
from rlbus.sdk.client import RLClient
from tests.waiting import eventually
from tests.weights_helpers import MODEL, assert_holds, first_watched_version, new_version, trained

PREFIX = "rl"
WORKERS = ("w0", "w1")


def _auth(env: dict[str, str]) -> NatsAuth:
    return NatsAuth(user=env["RLBUS_NATS_USER"], password=env["RLBUS_NATS_PASSWORD"], inbox=env.get("RLBUS_NATS_INBOX"))


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_NATS_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """(server, {identity: env}) for a server whose only users are the rlbus roles and one per worker."""
    paths = write_config(tmp_path_factory.mktemp("nats-secure"), prefix=PREFIX, workers=WORKERS)
    with NatsServer(config_file=paths["config"]) as server:
        yield server, {r: read_env_file(paths[r]) for r in identities(WORKERS)}


@pytest.fixture(scope="module")
async def fleet(secure):
    """Controller and workers started with THEIR credentials (read from RLBUS_NATS_*): each worker its own."""
    server, creds = secure
    subjects = Subjects(prefix=PREFIX)
    f = LocalFleet(server.url)
    with pytest.MonkeyPatch.context() as mp:
        for role, opts in [("controller", None)] + [(f"worker-{w}", w) for w in WORKERS]:
            for key in ("RLBUS_NATS_USER", "RLBUS_NATS_PASSWORD", "RLBUS_NATS_INBOX"):
                mp.setenv(key, creds[role][key])
            if opts is None:
                await f.start_controller(
                    ControllerOptions(subjects=subjects, command_timeout_s=10.0, liveness_timeout_s=1.5)
                )
            else:
                await f.start_worker(
                    ReferenceEngine(MODEL),
                    WorkerOptions(worker_id=opts, subjects=subjects, heartbeat_s=0.25, weight_transfer_backend="gloo"),
                )
    # bounded: a config that stops workers from answering shows here, not as a 2-minute hang
    await eventually(
        lambda: all(w in f.controller.registry for w in WORKERS),
        timeout=20,
        what="every worker registered under least-privilege credentials",
    )
    yield f
    await f.close()


@pytest.fixture(scope="module")
async def trainer(secure, fleet):
    server, creds = secure
    rl = await RLClient.connect(server.url, prefix=PREFIX, timeout=30.0, auth=_auth(creds["trainer"]))
    yield rl
    await rl.close()


async def test_fleet_works_end_to_end_with_least_privilege(fleet, trainer):
    info = await trainer.server_info()
    assert [w.worker_id for w in info.workers] == list(WORKERS)

    paused = await trainer.pause("wait")
    assert all(w.paused for w in paused.workers)
    resumed = await trainer.resume()
    assert not any(w.paused for w in resumed.workers)

    named = trained(11)
    version = new_version("secure")
    ack = await trainer.push_weights(named, version)
    assert ack.weight_version == version
    for wid in WORKERS:
        assert_holds(fleet, wid, named)
    assert (await trainer.server_info()).weight_version == version
    assert await first_watched_version(trainer) == version  # KV read as the trainer

    reply = await trainer.generate([1, 2, 3], 4)
    assert reply.finish_reason == "length" and reply.weight_version == version
    assert not denials_of(trainer.nc).seen
    assert fleet.all_running()


async def test_a_worker_identity_cannot_send_control_commands(secure, fleet, trainer):
    server, creds = secure
    async with await RLClient.connect(server.url, prefix=PREFIX, timeout=30.0, auth=_auth(creds["worker-w0"])) as rogue:
        t0 = time.monotonic()
        with pytest.raises(rlbus.PermissionDenied) as err:
            await rogue.pause("abort")
        took = time.monotonic() - t0
    assert err.value.code == "PERMISSION_DENIED"
    assert took < 5.0, f"the denial took {took:.1f}s; it must not wait for the call's timeout"
    assert not await trainer.is_paused()
    assert all(not w.engine.status().paused for w in fleet.workers.values())


async def test_a_trainer_cannot_command_a_worker_directly(secure, fleet, trainer):
    server, creds = secure
    nc = await connect(server.url, name="rogue-trainer", auth=_auth(creds["trainer"]))
    try:
        rogue = RLClient(nc, subjects=Subjects(prefix=PREFIX), timeout=30.0)
        subject = rogue.subjects.worker("w0", "pause")
        t0 = time.monotonic()
        with pytest.raises(rlbus.PermissionDenied):
            await request(nc, subject, encode(PauseWorker(mode="abort", epoch=0, command_id="rogue")), 30.0)
        assert time.monotonic() - t0 < 5.0
        assert denials_of(nc).denied(subject)
        assert ("publish", subject) in denials_of(nc).seen
    finally:
        await drain(nc)
    states = (await trainer.server_info()).workers
    assert not any(w.state.paused for w in states)
    assert not fleet.workers["w0"].engine.status().paused


async def test_a_wrong_password_is_refused_quickly(secure):
    server, _ = secure
    t0 = time.monotonic()
    with pytest.raises(rlbus.PermissionDenied) as err:
        await RLClient.connect(server.url, prefix=PREFIX, auth=NatsAuth(user="rlbus-trainer", password="wrong"))
    assert err.value.code == "PERMISSION_DENIED"
    assert time.monotonic() - t0 < 10.0


def test_the_cli_refuses_a_wrong_password_naming_permission_denied(secure):
    server, _ = secure
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus",
            "status",
            "--nats-url",
            server.url,
            "--nats-user",
            "rlbus-trainer",
            "--nats-password",
            "wrong",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert result.returncode != 0
    assert "PERMISSION_DENIED" in result.stderr, result.stderr


async def test_an_observer_reads_the_version_but_cannot_pause(secure, fleet, trainer):
    server, creds = secure
    committed = (await trainer.server_info()).weight_version
    async with await RLClient.connect(server.url, prefix=PREFIX, timeout=30.0, auth=_auth(creds["observer"])) as obs:
        assert await first_watched_version(obs) == committed
        t0 = time.monotonic()
        with pytest.raises(rlbus.PermissionDenied):
            await obs.pause()
        assert time.monotonic() - t0 < 5.0
    assert not await trainer.is_paused()


def test_a_service_started_with_the_wrong_role_exits_2_naming_the_subject(secure, fleet):
    server, creds = secure
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus", "worker", "--nats-url", server.url, "--id", "bad"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(**creds["trainer"]),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rl.worker.bad" in proc.stderr.lower() or "rl.worker.ready" in proc.stderr.lower(), proc.stderr[-3000:]
    assert "denies" in proc.stderr or "denied" in proc.stderr.lower()


def test_a_controller_started_with_a_workers_credentials_exits_2_naming_the_jetstream_subject(secure, fleet):
    server, creds = secure
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus", "controller", "--nats-url", server.url, "--prefix", "rlx"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(**creds["worker-w0"]),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "$js.api" in proc.stderr.lower() and "denies" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 4.5, "the denial must end the process, not a JetStream timeout (5 s)"


def test_nats_config_cli_writes_private_files_a_server_accepts(tmp_path):
    out = tmp_path / "conf"
    result = subprocess.run(
        [sys.executable, "-m", "rlbus", "nats-config", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert result.returncode == 0, result.stderr
    files = {p.name: p for p in out.iterdir()}
    assert set(files) == {"nats.conf", *(f"{r}.env" for r in identities(["worker-0", "worker-1"]))}
    for p in files.values():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, f"{p.name} is {oct(p.stat().st_mode)}"
    for r in identities(["worker-0", "worker-1"]):
        env = read_env_file(files[f"{r}.env"])
        assert env["RLBUS_NATS_USER"] == f"rlbus-{r}" and len(env["RLBUS_NATS_PASSWORD"]) >= 16
    with NatsServer(config_file=files["nats.conf"]) as server:
        assert server.running()
        _check_login(server.url, read_env_file(files["trainer.env"]))


def _check_login(url: str, env: dict[str, str]) -> None:
    import anyio

    async def login() -> None:
        nc = await connect(url, name="login-check", auth=_auth(env))
        await drain(nc)
        with pytest.raises(PermissionError):
            await connect(url, name="login-check", auth=NatsAuth(user=env["RLBUS_NATS_USER"], password="nope"))

    anyio.run(login)


# ---- one identity per worker; replies only to their requester ----------------------------------


async def _denied(nc, subject: str) -> None:
    await eventually(lambda: denials_of(nc).denied(subject), timeout=5, what=f"the server refusing {subject}")


async def test_a_worker_identity_cannot_evict_another_worker(secure, fleet, trainer):
    server, creds = secure
    # the sync tests before this one block the module's loop for seconds (subprocess.run): the
    # in-process workers missed heartbeats and rejoin now; wait for the whole fleet first
    await fleet.wait_for_workers(WORKERS)
    subjects = Subjects(prefix=PREFIX)
    nc = await connect(server.url, name="rogue-w0", auth=_auth(creds["worker-w0"]))
    try:
        forged = subjects.worker_event("w1", "gone")
        await nc.publish(forged, encode(WorkerGone(worker_id="w1", reason="forged")))
        await _denied(nc, forged)
        # under its own id, a goodbye that claims to be w1's is ignored by the controller
        await nc.publish(subjects.worker_event("w0", "gone"), encode(WorkerGone(worker_id="w1", reason="forged")))
        await nc.flush()
    finally:
        await drain(nc)
    paused = await trainer.pause("abort")  # the next fan-out still counts w1
    try:
        assert [w.worker_id for w in paused.workers] == list(WORKERS)
        assert "w1" in fleet.controller.registry
    finally:
        await trainer.resume()


async def test_a_worker_identity_cannot_hear_or_answer_another_workers_commands(secure, fleet, trainer):
    server, creds = secure
    # the sync tests before this one block the module's loop for seconds (subprocess.run): the
    # in-process workers missed heartbeats and rejoin now; wait for the whole fleet first
    await fleet.wait_for_workers(WORKERS)
    subjects = Subjects(prefix=PREFIX)
    nc = await connect(server.url, name="rogue-w0", auth=_auth(creds["worker-w0"]))
    forged = encode(WorkerAck(state=WorkerState(worker_id="w1", paused=True, weight_version="FORGED")))

    async def answer(msg) -> None:
        await msg.respond(forged)

    try:
        subject = subjects.worker("w1", "status")
        await nc.subscribe(subject, cb=answer)
        await _denied(nc, subject)
        for _ in range(8):
            assert not await trainer.is_paused()
        assert "FORGED" not in await trainer.get_weight_version()
    finally:
        await drain(nc)


async def test_no_identity_can_read_the_replies_of_another(secure, fleet):
    server, creds = secure
    for identity in ("trainer", "observer", "worker-w0"):
        nc = await connect(server.url, name=f"snoop-{identity}", auth=_auth(creds[identity]))
        try:
            await nc.subscribe("_INBOX.>")
            await _denied(nc, "_INBOX.>")
        finally:
            await drain(nc)


async def test_the_trainer_and_the_observer_discover_the_services_with_standard_tooling(secure, fleet):
    server, creds = secure
    for identity in ("trainer", "observer"):
        nc = await connect(server.url, name=f"tooling-{identity}", auth=_auth(creds[identity]))
        try:
            msg = await request(nc, "$SRV.PING.rlbus-controller", b"", 5.0)
            assert b"rlbus-controller" in msg.data
        finally:
            await drain(nc)


def test_a_worker_with_another_workers_credentials_cannot_join_as_it(secure, fleet):
    server, creds = secure
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus", "worker", "--nats-url", server.url, "--id", "w1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(**creds["worker-w0"]),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rl.worker.w1.status" in proc.stderr.lower() and "denies" in proc.stderr, proc.stderr[-3000:]
    assert "w1" in fleet.controller.registry


async def test_a_reader_cannot_make_the_server_publish_on_rl_version(secure, fleet, trainer):
    server, creds = secure
    stream = Subjects(prefix=PREFIX).kv_stream
    config = json.dumps(
        {
            "stream_name": stream,
            "config": {"deliver_subject": "rl.version", "deliver_policy": "all", "ack_policy": "none"},
        }
    ).encode()
    for identity in ("observer", "trainer"):
        nc = await connect(server.url, name=f"rogue-{identity}", auth=_auth(creds[identity]))
        try:
            with pytest.raises(rlbus.PermissionDenied):
                await request(nc, f"$JS.API.CONSUMER.CREATE.{stream}", config, 5.0)
        finally:
            await drain(nc)
    committed = (await trainer.server_info()).weight_version
    async with await RLClient.connect(server.url, prefix=PREFIX, timeout=30.0, auth=_auth(creds["observer"])) as obs:
        assert await first_watched_version(obs) == committed  # watching needs no consumer


# ---- discovery: every role that may use it is answered by each service, and stops none ---------


async def discovery_replies(nc, subject: str, want: int, timeout: float = 10.0) -> list[dict]:
    """Send one discovery request and collect replies until `want` came (or the timeout: then
    what came, for the assert to show)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    replies: list[dict] = []
    try:
        while len(replies) < want:
            replies.append(json.loads((await sub.next_msg(timeout=timeout)).data))
    except Exception:
        pass
    finally:
        await sub.unsubscribe()
    return replies


@pytest.mark.parametrize("role", ["trainer", "observer"])
@pytest.mark.parametrize("verb", ["PING", "INFO", "STATS"])
async def test_discovery_from_a_role_is_answered_by_every_service_and_denies_nothing(secure, fleet, role, verb):
    server, creds = secure
    before = {wid: len(denials_of(w.nc).seen) for wid, w in fleet.workers.items()}
    nc = await connect(server.url, name=f"discovery-{role}", auth=_auth(creds[role]))
    try:
        want = 1 + 2 * len(WORKERS)

        async def every_service() -> list[dict] | None:  # a worker withheld (rejoining) serves no generation yet
            replies = await discovery_replies(nc, f"$SRV.{verb}", want=want, timeout=2)
            return replies if len(replies) == want else None

        replies = await eventually(every_service, timeout=30, what="every service answering")
        assert not denials_of(nc).seen
    finally:
        await drain(nc)
    names = sorted(r["name"] for r in replies)
    assert names == sorted(["rlbus-controller", *["rlbus-worker", "rlbus-generate"] * len(WORKERS)]), names
    for wid, worker in fleet.workers.items():
        denied = [d for d in denials_of(worker.nc).seen[before[wid] :] if d[0] == "publish"]
        assert not denied, f"{wid}: a reply to discovery was denied"
    assert fleet.all_running()


async def test_a_denied_reply_to_a_discovery_request_does_not_stop_a_worker(tmp_path):
    """A worker under a config that lets it answer each request only once (as rlbus's did): its
    second service's reply to a discovery request is denied, and the worker keeps running."""
    import anyio

    from tests.fleet import worker_command

    paths = write_config(tmp_path / "conf", prefix=PREFIX, workers=["w9"])
    text = paths["config"].read_text()
    assert '"max": 3' in text
    paths["config"].write_text(re.sub(r'"allow_responses": \{\s*"max": 3\s*\}', '"allow_responses": true', text))
    assert '"max": 3' not in paths["config"].read_text()
    log = tmp_path / "worker.log"
    # starting processes and opening a log file return at once: nothing here waits on them
    with NatsServer(config_file=paths["config"]) as server, open(log, "w") as err:  # noqa: ASYNC230
        controller = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "rlbus", "controller", "--nats-url", server.url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_clean_env(**read_env_file(paths["controller"])),
        )
        proc = subprocess.Popen(  # noqa: ASYNC220
            worker_command(server.url, PREFIX, "w9", "gloo", MODEL),
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=_clean_env(**read_env_file(paths["worker-w9"])),
        )
        nc = await connect(server.url, name="discovery", auth=_auth(read_env_file(paths["trainer"])))
        try:
            await eventually(
                lambda: proc.poll() is not None or discovery_replies(nc, "$SRV.PING.rlbus-generate", 1, timeout=1),
                timeout=60,
                what="the worker serving generation (both its services up)",
            )
            assert proc.poll() is None, log.read_text()[-3000:]
            await discovery_replies(nc, "$SRV.PING", 2, timeout=2)  # its second reply is denied
            await eventually(
                lambda: "carrying on" in log.read_text() or proc.poll() is not None,
                timeout=20,
                what="the denial reported",
            )
            assert await discovery_replies(nc, "$SRV.PING.rlbus-worker", 1), "the worker still answers"
            assert proc.poll() is None and "Stopping" not in log.read_text(), log.read_text()[-3000:]
        finally:
            await drain(nc)
            for p in (proc, controller):
                p.terminate()
                await anyio.to_thread.run_sync(p.wait, 20)
