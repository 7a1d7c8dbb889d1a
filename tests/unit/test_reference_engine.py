"""The reference engine alone, no NATS: generation, pause modes, sleep levels and tags."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from rlbus.schemas import GenerateReply, GenerateRequest
from rlbus.schemas.errors import FailedPrecondition, InvalidArgument
from rlbus.services.worker.book import Book
from rlbus.services.worker.engine import NotStarted
from rlbus.services.worker.reference_engine import ReferenceEngine

from rlbus.models.tinylm import ModelConfig
from tests.waiting import eventually

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=256, seed=0)
LONG = 100
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def request(prompt: list[int] = PROMPTS[0], max_tokens: int = 8, **kw: object) -> GenerateRequest:
    return GenerateRequest(prompt_tokens=prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def start(engine: ReferenceEngine, prompts=PROMPTS, max_tokens: int = LONG) -> list[asyncio.Task[GenerateReply]]:
    return [asyncio.create_task(engine.generate(request(p, max_tokens))) for p in prompts]


async def running(engine: ReferenceEngine, n: int = len(PROMPTS)) -> None:
    await eventually(lambda: engine.status().in_flight == n, what=f"{n} requests running")


async def tokens_of(engine: ReferenceEngine, max_tokens: int = 12) -> list[list[int]]:
    return [(await engine.generate(request(p, max_tokens))).tokens for p in PROMPTS]


@pytest.fixture
def engine() -> ReferenceEngine:
    return ReferenceEngine(CFG)


# ---- generation --------------------------------------------------------------------------


async def test_greedy_generation_is_deterministic_across_engines_with_the_same_seed(engine):
    first = await engine.generate(request(max_tokens=10))
    assert first.finish_reason == "length" and len(first.tokens) == 10
    assert all(0 <= t < CFG.vocab_size for t in first.tokens)
    assert first.weight_version == "default" and first.logprobs is None
    assert (await engine.generate(request(max_tokens=10))).tokens == first.tokens
    assert (await ReferenceEngine(CFG).generate(request(max_tokens=10))).tokens == first.tokens


async def test_engines_with_different_seeds_generate_differently(engine):
    other = ReferenceEngine(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=256, seed=1))
    assert await tokens_of(engine) != await tokens_of(other)


async def test_sampling_with_the_same_seed_repeats_and_returns_logprobs(engine):
    req = request(max_tokens=16, temperature=1.0, seed=7, return_logprobs=True)
    a, b = await engine.generate(req), await engine.generate(req)
    assert a.tokens == b.tokens
    assert a.logprobs is not None and len(a.logprobs) == 16 and all(lp <= 0 for lp in a.logprobs)


async def test_concurrent_requests_give_the_same_tokens_as_sequential_ones(engine):
    sequential = await tokens_of(engine, 40)
    concurrent = await asyncio.gather(*start(engine, max_tokens=40))
    assert [r.tokens for r in concurrent] == sequential


@pytest.mark.parametrize(
    "bad",
    [
        request(prompt=[]),
        request(prompt=[1, 64]),
        request(prompt=[-1]),
        request(max_tokens=0),
        request(prompt=[1] * 200, max_tokens=57),
        request(temperature=-0.5),
        request(temperature=math.nan),
    ],
    ids=[
        "empty-prompt",
        "token-past-vocab",
        "negative-token",
        "zero-max-tokens",
        "past-max-seq-len",
        "negative-temperature",
        "nan-temperature",
    ],
)
async def test_an_invalid_request_is_refused_with_invalid_argument(engine, bad):
    with pytest.raises(InvalidArgument):
        await engine.generate(bad)
    assert engine.status().in_flight == 0


# ---- pause -------------------------------------------------------------------------------


async def test_unknown_pause_mode_is_refused_with_invalid_argument(engine):
    with pytest.raises(InvalidArgument):
        await engine.pause("sideways")  # type: ignore[arg-type]
    assert not engine.status().paused


async def test_pause_abort_ends_running_requests_with_abort(engine):
    tasks = start(engine)
    await running(engine)

    await engine.pause("abort")

    assert engine.status().in_flight == 0
    assert all(t.done() for t in tasks), "pause(abort) returns once the requests have ended"
    results = [t.result() for t in tasks]
    assert all(r.finish_reason == "abort" and len(r.tokens) < LONG for r in results)


async def test_pause_wait_returns_after_running_requests_finish(engine):
    tasks = start(engine)
    await running(engine)

    await engine.pause("wait")

    assert all(t.done() for t in tasks)
    assert all(t.result().finish_reason == "length" and len(t.result().tokens) == LONG for t in tasks)
    s = engine.status()
    assert s.paused and s.pause_mode == "wait" and s.in_flight == 0


async def test_pause_keep_freezes_requests_and_resume_continues_them_with_identical_tokens(engine):
    reference = await tokens_of(engine, LONG)
    tasks = start(engine)
    await running(engine)

    await engine.pause("keep")
    assert engine.status().in_flight == len(PROMPTS) and not any(t.done() for t in tasks)
    await engine.pause("keep")  # idempotent: returns at once, requests stay frozen
    assert not any(t.done() for t in tasks)

    await engine.resume()
    results = await asyncio.gather(*tasks)
    assert [r.tokens for r in results] == reference
    assert all(r.finish_reason == "length" for r in results)


async def test_a_relabel_while_requests_are_frozen_names_the_tokens_decoded_after_it(engine):
    """The same bits under a new (version, seq): tokens unchanged, a second span from the resume on."""
    book = Book()
    engine.attach(book)
    reference = await tokens_of(engine, LONG)
    tasks = start(engine)
    await running(engine)
    await engine.pause("keep")
    book.relabel("v2", 1)
    await engine.resume()
    for r, ref in zip(await asyncio.gather(*tasks), reference):
        assert r.tokens == ref
        spans = [(s.version, s.seq, s.start, s.end) for s in r.weight_versions]
        assert len(spans) in (1, 2) and spans[-1][:2] == ("v2", 1) and spans[-1][3] == LONG, spans
        assert (r.weight_version, r.weight_seq) == spans[0][:2]
        if len(spans) == 2:
            assert spans[0][:3] == ("default", 0, 0) and spans[0][3] == spans[1][2]


async def test_pause_abort_ends_requests_frozen_by_keep(engine):
    tasks = start(engine)
    await running(engine)
    await engine.pause("keep")

    await engine.pause("abort")

    assert engine.status().pause_mode == "abort"
    results = await asyncio.gather(*tasks)
    assert all(r.finish_reason == "abort" for r in results)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_requests_arriving_while_paused_wait_for_resume(engine, mode):
    await engine.pause(mode)
    tasks = start(engine, max_tokens=4)
    await eventually(lambda: engine.status().waiting == len(PROMPTS), what="requests queued")
    assert engine.status().in_flight == 0 and not any(t.done() for t in tasks)

    await engine.resume()

    results = await asyncio.gather(*tasks)
    assert all(r.finish_reason == "length" and len(r.tokens) == 4 for r in results)
    assert engine.status().waiting == 0


async def test_a_request_queued_for_a_free_slot_does_not_start_while_paused():
    engine = ReferenceEngine(CFG, max_concurrency=1)
    first, queued = start(engine, PROMPTS[:2])
    await running(engine, 1)

    await engine.pause("abort")
    assert (await first).finish_reason == "abort"

    # the second request only got its slot after the pause began: it must wait for resume
    await eventually(lambda: queued.done() or engine.status().waiting == 1, what="queued request settled")
    if queued.done():
        r = queued.result()
        pytest.fail(f"the queued request ran while paused: {r.finish_reason}, {len(r.tokens)} tokens")
    assert engine.status().in_flight == 0
    await engine.resume()
    assert (await queued).finish_reason == "length"


async def test_hand_back_ends_every_request_held_and_not_started_and_leaves_running_ones_alone():
    """A worker that stops hands back what the engine holds and never started: a request held by
    the pause, one queued for the busy slot (once it gets the slot), one arriving after; the
    frozen one runs on."""
    engine = ReferenceEngine(CFG, max_concurrency=1)
    (frozen,) = start(engine, PROMPTS[:1])
    await running(engine, 1)
    (queued,) = start(engine, PROMPTS[1:2], max_tokens=6)
    await eventually(lambda: engine._slot_free.statistics().tasks_waiting == 1, what="one queued for the slot")
    await engine.pause("keep")
    (held,) = start(engine, PROMPTS[2:], max_tokens=6)
    await eventually(lambda: engine.status().waiting == 1, what="one held by the pause")

    engine.hand_back()

    with pytest.raises(NotStarted, match="not started"):
        await held
    with pytest.raises(NotStarted):
        await engine.generate(request(max_tokens=2))
    assert engine.status().waiting == 0 and not frozen.done() and not queued.done()
    await engine.resume()
    assert (await frozen).finish_reason == "length"
    with pytest.raises(NotStarted):
        await queued


async def test_pause_and_resume_are_idempotent(engine):
    await engine.resume()  # resume when not paused is a no-op
    assert not engine.status().paused
    await engine.pause("wait")
    await engine.pause("wait")
    assert engine.status().paused and engine.status().pause_mode == "wait"
    await engine.resume()
    await engine.resume()
    s = engine.status()
    assert not s.paused and s.pause_mode is None
    assert len((await engine.generate(request())).tokens) == 8


# ---- sleep -------------------------------------------------------------------------------


async def test_sleep_level_1_frees_weights_and_cache_and_wake_restores_identical_output(engine):
    before = await tokens_of(engine)
    awake = engine.status()
    assert awake.param_bytes > 0 and awake.kv_cache_bytes > 0

    await engine.sleep(1, ["weights", "kv_cache"])
    s = engine.status()
    assert s.param_bytes == 0 and s.kv_cache_bytes == 0
    assert s.sleeping_tags == ["weights", "kv_cache"] and s.sleep_level == 1 and s.weights_loaded

    await engine.wake_up(["weights", "kv_cache"])
    s = engine.status()
    assert (s.param_bytes, s.kv_cache_bytes) == (awake.param_bytes, awake.kv_cache_bytes)
    assert s.sleeping_tags == [] and s.sleep_level == 0
    assert await tokens_of(engine) == before


async def test_sleep_level_2_discards_weights_and_generation_is_refused_until_weights_arrive(engine):
    before = await tokens_of(engine)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    await engine.sleep(2, ["weights", "kv_cache"])
    assert engine.status().param_bytes == 0 and not engine.status().weights_loaded
    await engine.wake_up(["weights", "kv_cache"])

    s = engine.status()
    assert not s.sleeping_tags and not s.weights_loaded and s.param_bytes > 0
    with pytest.raises(FailedPrecondition):
        await engine.generate(request())

    await engine.load_weights("main", weights)
    assert engine.status().weights_loaded
    assert await tokens_of(engine) == before


async def test_param_and_cache_bytes_are_the_resident_storage_after_every_sleep_wake_and_load():
    """Counted where the storages change, not on every report: they must still match a walk over
    the storages (verifier and draft) after each step that could change them, and the tensors a
    receive writes into must still be the model's."""
    engine = ReferenceEngine(
        CFG, draft_config=ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=256, seed=1)
    )
    assert engine.draft is not None
    parts = [engine.main, engine.draft]

    def walked() -> tuple[int, int]:
        params = sum(p.untyped_storage().nbytes() for part in parts for p in part.model.parameters())
        caches = sum(t.untyped_storage().nbytes() for part in parts for t in (part.kv.k, part.kv.v))
        return params, caches

    def reported() -> tuple[int, int]:
        s = engine.status()
        for target, part in (("main", engine.main), ("draft", engine.draft)):  # what a receive writes into
            live = engine.parameters_of(target)
            held = dict(part.model.named_parameters())
            assert live.keys() == held.keys() and all(live[n].data_ptr() == p.data_ptr() for n, p in held.items())
        return s.param_bytes, s.kv_cache_bytes

    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    steps = [
        lambda: engine.sleep(1, ["weights"]),
        lambda: engine.wake_up(["weights"]),
        lambda: engine.sleep(1, ["kv_cache"]),
        lambda: engine.wake_up(["kv_cache"]),
        lambda: engine.sleep(2, ["weights", "kv_cache"]),
        lambda: engine.wake_up(["weights", "kv_cache"]),
        lambda: engine.load_weights("main", weights),
    ]
    seen = [reported()]
    assert seen[0] == walked() and min(seen[0]) > 0
    for step in steps:
        await step()
        seen.append(reported())
        assert seen[-1] == walked()
    full, (params, caches) = seen[0], seen[0]
    assert seen == [full, (0, caches), full, (params, 0), full, (0, 0), full, full]


async def test_sleeping_only_the_kv_cache_keeps_weights_resident(engine):
    params = engine.status().param_bytes
    await engine.sleep(1, ["kv_cache"])
    s = engine.status()
    assert s.kv_cache_bytes == 0 and s.param_bytes == params and s.sleeping_tags == ["kv_cache"]


async def test_waking_only_the_weights_leaves_the_cache_asleep(engine):
    await engine.sleep(1, ["weights", "kv_cache"])
    await engine.wake_up(["weights"])
    s = engine.status()
    assert s.sleeping_tags == ["kv_cache"] and s.param_bytes > 0 and s.kv_cache_bytes == 0 and s.sleep_level == 1
    with pytest.raises(FailedPrecondition):
        await engine.generate(request())
    await engine.wake_up(["kv_cache"])
    assert engine.status().sleeping_tags == [] and engine.status().sleep_level == 0


async def test_sleep_and_wake_are_idempotent(engine):
    before = await tokens_of(engine)
    await engine.sleep(1, ["weights", "kv_cache"])
    await engine.sleep(1, ["weights", "kv_cache"])  # a second sleep must not back up the freed storage
    await engine.wake_up(["weights", "kv_cache"])
    await engine.wake_up(["weights", "kv_cache"])
    assert engine.status().sleeping_tags == []
    assert await tokens_of(engine) == before


@pytest.mark.parametrize("tags", [["weights", "kv_cache"], ["weights"], ["kv_cache"]])
async def test_generation_while_asleep_is_refused_with_failed_precondition(engine, tags):
    await engine.sleep(1, tags)
    with pytest.raises(FailedPrecondition, match="asleep"):
        await engine.generate(request())
    assert engine.status().in_flight == 0


async def test_sleep_is_refused_while_requests_are_in_flight(engine):
    tasks = start(engine)
    await running(engine)
    await engine.pause("keep")

    with pytest.raises(FailedPrecondition):
        await engine.sleep(1, ["weights", "kv_cache"])

    s = engine.status()
    assert s.sleeping_tags == [] and s.param_bytes > 0 and s.kv_cache_bytes > 0 and s.paused
    await engine.resume()
    assert all(r.finish_reason == "length" for r in await asyncio.gather(*tasks))


async def test_sleep_is_refused_when_sleep_mode_is_off():
    engine = ReferenceEngine(CFG, sleep_mode_enabled=False)
    with pytest.raises(FailedPrecondition):
        await engine.sleep(1, ["weights", "kv_cache"])
    assert engine.status().param_bytes > 0


async def test_sleep_level_other_than_1_or_2_is_refused_with_invalid_argument(engine):
    with pytest.raises(InvalidArgument):
        await engine.sleep(3, ["weights"])
    assert engine.status().sleeping_tags == []


async def test_a_request_queued_behind_a_pause_is_refused_if_the_engine_fell_asleep(engine):
    await engine.pause("wait")
    task = asyncio.create_task(engine.generate(request()))
    await eventually(lambda: engine.status().waiting == 1, what="request queued")
    await engine.sleep(1, ["weights", "kv_cache"])

    await engine.resume()

    with pytest.raises(FailedPrecondition):
        await task


async def test_loading_weights_while_they_sleep_is_refused(engine):
    weights = {n: torch.zeros_like(p) for n, p in engine.model.named_parameters()}
    await engine.sleep(1, ["weights"])
    with pytest.raises(FailedPrecondition):
        await engine.load_weights("main", weights)
