"""Hypothesis against a live controller and worker: whatever arrives on a command subject —
random bytes, wrong-kind commands, well-typed commands with impossible values — gets a reply
(a typed Nack or a 400 service error) and changes nothing.

Payloads are invalid by construction (valid pause/sleep/start/init/version/sync commands are
never generated), so the fleet's state after the run must equal the state before it.
Each test runs hypothesis in a thread; each example is sent on the module's event loop.
"""

from __future__ import annotations

import json

import anyio
import anyio.from_thread
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.errors import NoRespondersError
from rlbus.schemas import (
    CONTROL_OPS,
    ERROR_CODES,
    UNDECODABLE_STATUS,
    WORKER_OPS,
    AbortWeightUpdate,
    AbortWeightUpdateWorker,
    BucketMeta,
    CommitWorker,
    FinishWeightUpdate,
    GenerateRequest,
    GetServerInfo,
    InitWeightTransfer,
    Nack,
    ParamMeta,
    Pause,
    PauseWorker,
    PrepareWorker,
    Sleep,
    SleepWorker,
    StartWeightUpdate,
    StartWeightUpdateWorker,
    StatusWorker,
    SyncWorker,
    TransferInit,
    UpdateWeights,
    UpdateWeightsWorker,
    UpdateWeightVersion,
    UpdateWeightVersionWorker,
    WakeUp,
    WakeUpWorker,
    encode,
    generate_reply_decoder,
    reply_decoder,
    version_problem,
)

from tests.fleet import start_fleet
from tests.weights_helpers import MODEL, assert_holds, first_watched_version, trained

VERSION = "v-fuzz"
REPLY_TIMEOUT_S = 5.0
FUZZ = settings(
    max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    f, rl = await start_fleet(nats_server.url, prefix, ("w0",), weight_transfer_backend="gloo", model=MODEL)
    named = trained(5)
    await rl.push_weights(named, VERSION)
    yield f, rl, dict(named)
    await rl.close()
    await f.close()


# ---- strategies: payloads that must be refused -----------------------------------------------

text = st.text(max_size=40)
bad_versions = st.one_of(
    st.just(""),
    st.text(alphabet=" \t\n", min_size=1, max_size=5),
    st.text(min_size=129, max_size=400),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
).filter(lambda v: version_problem(v) is not None)
dtypes = st.sampled_from(["float32", "float16", "bfloat16", "int8", "bool", "complex64", "", "float"])
param_meta = st.builds(
    ParamMeta,
    name=st.one_of(text, st.just("embed.weight")),
    dtype=dtypes,
    shape=st.lists(st.integers(-2, 2**62), max_size=4),
    bucket=st.integers(-3, 2**40),
    offset=st.integers(-(2**40), 2**40),
    nbytes=st.integers(-10, 2**62),
)
bucket_meta = st.builds(BucketMeta, index=st.integers(-3, 5), nbytes=st.integers(-10, 2**62))
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3),
    max_leaves=8,
)


def control_typed_but_wrong() -> st.SearchStrategy[object]:
    """Control commands whose kind matches some op but whose values no handler may accept (no session is open)."""
    return st.one_of(
        st.builds(Pause, mode=text.filter(lambda m: m not in ("abort", "wait", "keep"))),
        st.builds(Sleep, level=st.integers().filter(lambda x: x not in (1, 2))),
        st.builds(
            Sleep,
            level=st.sampled_from([1, 2]),
            tags=st.one_of(
                st.just([]), st.lists(text.filter(lambda t: t not in ("weights", "kv_cache")), min_size=1, max_size=3)
            ),
        ),
        st.builds(
            WakeUp, tags=st.lists(text.filter(lambda t: t not in ("weights", "kv_cache")), min_size=1, max_size=3)
        ),
        st.builds(StartWeightUpdate, target=text.filter(lambda t: t not in ("main", "draft"))),
        st.builds(
            InitWeightTransfer,
            backend=text.filter(lambda b: b not in ("nccl", "gloo", "shm")),
            init_info=st.builds(TransferInit, backend=st.just("gloo")),
        ),
        st.builds(
            UpdateWeights,
            params=st.lists(param_meta, max_size=4),
            buckets=st.lists(bucket_meta, max_size=3),
            session_id=text,
        ),
        st.builds(FinishWeightUpdate, weight_version=st.one_of(st.none(), bad_versions, text), session_id=text),
        st.builds(UpdateWeightVersion, new_version=bad_versions),
    )


def worker_typed_but_wrong(epoch: int) -> st.SearchStrategy[object]:
    """Worker commands whose kind matches some op but whose values no handler may accept (no session is open)."""
    e, cid = st.just(epoch), text
    return st.one_of(
        st.builds(PauseWorker, mode=text.filter(lambda m: m not in ("abort", "wait", "keep")), epoch=e, command_id=cid),
        st.builds(SleepWorker, level=st.integers().filter(lambda x: x not in (1, 2)), epoch=e, command_id=cid),
        st.builds(
            SleepWorker,
            level=st.sampled_from([1, 2]),
            tags=st.one_of(
                st.just([]), st.lists(text.filter(lambda t: t not in ("weights", "kv_cache")), min_size=1, max_size=3)
            ),
            epoch=e,
            command_id=cid,
        ),
        st.builds(
            WakeUpWorker,
            tags=st.lists(text.filter(lambda t: t not in ("weights", "kv_cache")), min_size=1, max_size=3),
            epoch=e,
            command_id=cid,
        ),
        st.builds(
            StartWeightUpdateWorker,
            session_id=text,
            target=text.filter(lambda t: t not in ("main", "draft")),
            epoch=e,
            command_id=cid,
        ),
        st.builds(
            UpdateWeightsWorker,
            params=st.lists(param_meta, max_size=4),
            buckets=st.lists(bucket_meta, max_size=3),
            session_id=text,
            check_only=st.booleans(),
            epoch=e,
            command_id=cid,
        ),
        st.builds(UpdateWeightVersionWorker, new_version=bad_versions, epoch=e, command_id=cid),
        st.builds(PrepareWorker, session_id=text, epoch=e, command_id=cid),
        st.builds(CommitWorker, session_id=text, weight_version=st.one_of(st.none(), text), epoch=e, command_id=cid),
        st.builds(SyncWorker, committed_version=st.integers(), epoch=e, command_id=cid),  # wrong type: never decodes
    )


def control_harmless() -> st.SearchStrategy[object]:
    """Valid commands that change nothing on a resumed, awake fleet with no session."""
    return st.one_of(
        st.builds(GetServerInfo, command_id=text), st.builds(AbortWeightUpdate, session_id=text, reason=text)
    )


def worker_harmless(epoch: int) -> st.SearchStrategy[object]:
    return st.one_of(
        st.builds(StatusWorker, command_id=text, epoch=st.just(epoch)),
        st.builds(AbortWeightUpdateWorker, session_id=text, reason=text, epoch=st.just(epoch), command_id=text),
    )


def payloads(
    ops: tuple[str, ...], typed_but_wrong: st.SearchStrategy[object], harmless: st.SearchStrategy[object]
) -> st.SearchStrategy[tuple[str, bytes, bool]]:
    """(op, payload, must_be_refused)."""
    op = st.sampled_from(ops + ("no_such_op", "x-y"))
    raw = st.tuples(op, st.binary(min_size=1, max_size=256), st.just(True))
    # any JSON but an object without a kind: on its own subject that is a valid command (the
    # subject names the op, unknown fields are ignored), so it is not garbage
    garbage_json = json_value.filter(lambda v: not (isinstance(v, dict) and "kind" not in v))
    js = st.tuples(
        op, garbage_json.map(lambda v: json.dumps(v).encode()).filter(lambda b: b not in (b'""',)), st.just(True)
    )
    typed = st.tuples(op, typed_but_wrong.map(encode), st.just(True))
    benign = st.tuples(op, harmless.map(encode), st.just(False))
    return st.one_of(raw, js, typed, benign)


def _must_refuse(op: str, data: bytes, refuse: bool) -> bool:
    try:
        kind = msgspec.json.decode(data).get("kind")
    except Exception:
        return True
    return refuse or kind != op


async def _ask(rl, subject: str, data: bytes):
    with anyio.fail_after(REPLY_TIMEOUT_S + 1):
        return await rl.nc.request(subject, data, timeout=REPLY_TIMEOUT_S)


def _check_reply(msg, subject: str, data: bytes, refuse: bool, *, generate: bool = False) -> None:
    headers = msg.headers or {}
    if "Nats-Service-Error-Code" in headers:
        assert headers["Nats-Service-Error-Code"] == UNDECODABLE_STATUS, (subject, data, headers)
        return
    reply = (generate_reply_decoder if generate else reply_decoder).decode(msg.data)
    if isinstance(reply, Nack):
        assert reply.code in ERROR_CODES
        return
    assert not refuse, f"{subject} accepted a payload it must refuse: {data[:300]!r} -> {reply}"


def _fuzz(rl, subject_of, strategy) -> int:
    """Run hypothesis in this (worker) thread; every example is a request on the event loop."""
    count = [0]

    @FUZZ
    @given(strategy)
    def one(example: tuple[str, bytes, bool]) -> None:
        op, data, refuse = example
        subject = subject_of(op)
        if ".worker." in subject and op not in WORKER_OPS:
            # workers have no unknown-op catch-all (it would double every command on the hot
            # path): the typed answer is NATS' no-responders status
            with pytest.raises(NoRespondersError):
                anyio.from_thread.run(_ask, rl, subject, data)
        else:
            msg = anyio.from_thread.run(_ask, rl, subject, data)
            _check_reply(msg, subject, data, _must_refuse(op, data, refuse))
        count[0] += 1

    one()
    return count[0]


async def _assert_unchanged(fleet, rl, named) -> None:
    assert fleet.all_running(), "a service stopped"
    info = await rl.server_info()
    if info.session_id:
        await rl.abort_weight_update("fuzz cleanup")
    assert info.session_id is None, "a fuzzed command opened a session"
    assert not await rl.is_paused() and not await rl.is_sleeping()
    for wid in fleet.workers:
        assert_holds(fleet, wid, named)
        assert fleet.workers[wid].book.main.version == VERSION
    assert info.weight_version == VERSION
    assert await rl.get_weight_version() == VERSION
    assert await first_watched_version(rl) == VERSION
    reply = await rl.generate([1, 2, 3], 4)
    assert reply.weight_version == VERSION and reply.finish_reason == "length"


async def test_control_subjects_refuse_garbage_and_change_nothing(fleet):
    f, rl, named = fleet
    n = await anyio.to_thread.run_sync(
        _fuzz, rl, rl.subjects.control, payloads(CONTROL_OPS, control_typed_but_wrong(), control_harmless())
    )
    assert n >= 30
    await _assert_unchanged(f, rl, named)


async def test_generate_answers_every_request_with_a_reply_or_a_refusal(fleet):
    f, rl, named = fleet
    requests = st.builds(
        GenerateRequest,
        prompt_tokens=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 63), max_size=200),
        max_tokens=st.integers(-5, 10**9) | st.integers(0, 8),
        temperature=st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 2),
        seed=st.none() | st.integers(-(2**63), 2**64),
    ).map(encode)
    strategy = st.one_of(
        requests, st.binary(min_size=1, max_size=128), json_value.map(lambda v: json.dumps(v).encode())
    )

    def run() -> int:
        count = [0]

        @FUZZ
        @given(strategy)
        def one(data: bytes) -> None:
            msg = anyio.from_thread.run(_ask, rl, rl.subjects.generate, data)
            _check_reply(msg, rl.subjects.generate, data, False, generate=True)
            count[0] += 1

        one()
        return count[0]

    n = await anyio.to_thread.run_sync(run)
    assert n >= 30
    await _assert_unchanged(f, rl, named)


async def test_worker_subjects_refuse_garbage_and_change_nothing(fleet):
    # sent straight to w0 with the controller's epoch, so handlers run (not just the fence)
    f, rl, named = fleet
    epoch = (await rl.server_info()).epoch
    n = await anyio.to_thread.run_sync(
        _fuzz,
        rl,
        lambda op: rl.subjects.worker("w0", op),
        payloads(WORKER_OPS, worker_typed_but_wrong(epoch), worker_harmless(epoch)),
    )
    assert n >= 30
    await _assert_unchanged(f, rl, named)


async def test_a_refused_worker_command_from_a_future_epoch_does_not_fence_out_the_controller(fleet):
    f, rl, named = fleet
    epoch = (await rl.server_info()).epoch
    future = PrepareWorker(session_id="nope", epoch=epoch + 1000, command_id="future")
    msg = await _ask(rl, rl.subjects.worker("w0", "prepare"), encode(future))
    assert isinstance(reply_decoder.decode(msg.data), Nack)
    assert f.workers["w0"].book.epoch == epoch, "a refused command moved the worker's fence"
    await rl.pause("wait")  # the real controller must still command w0
    await rl.resume()
    await _assert_unchanged(f, rl, named)


async def test_a_worker_refuses_an_invalid_version_sent_to_it_directly(fleet):
    f, rl, named = fleet
    epoch = (await rl.server_info()).epoch
    empty = UpdateWeightVersionWorker(new_version="", epoch=epoch, command_id="empty-version")
    msg = await _ask(rl, rl.subjects.worker("w0", "update_weight_version"), encode(empty))
    reply = reply_decoder.decode(msg.data)
    assert isinstance(reply, Nack) and reply.code == "INVALID_ARGUMENT", reply
    assert f.workers["w0"].book.main.version == VERSION
