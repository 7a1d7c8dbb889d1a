"""Versions that name every token (issue #24, item 2): a reply whose tokens came from more
than one set of weights says which tokens each set produced, as vLLM's `weight_versions`
spans do (plus the commit seq). A reference-engine worker, staged updates, long requests in
flight while a commit lands: with no pause at all, and frozen by pause(keep) across a push.

Each reply is checked against a local greedy decode that switches weights at the reply's own
span boundary, keeping its KV cache (what the engine does between two steps): a boundary one
token off would decode other tokens.
"""

from __future__ import annotations

import asyncio

import pytest
from rlbus.schemas import GenerateReply

from tests.fleet import LONG, PROMPTS, fleet_running
from tests.waiting import eventually
from tests.weights_helpers import engine_snapshot, greedy_switched, new_version, trained

MODEL = LONG
MAX_TOKENS = 200
"""Long enough that a commit lands while every request still decodes."""


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix, ("w0",), model=MODEL, weight_transfer_backend="shm") as running:
        yield running


@pytest.fixture(autouse=True)
async def idle_fleet(fleet):
    f, rl = fleet
    yield
    await rl.resume()
    await eventually(lambda: in_flight(f) == 0, what="fleet idle after test")


def in_flight(f) -> int:
    return sum(w.engine.status().in_flight for w in f.workers.values())


def long_requests(rl) -> list[asyncio.Task[GenerateReply]]:
    return [asyncio.create_task(rl.generate(p, MAX_TOKENS, timeout=60.0)) for p in PROMPTS]


async def push_explicitly(rl, named, version: str) -> None:
    """init -> start -> update -> finish, with no pause: the commit lands between two steps."""
    await rl.init_weight_transfer(timeout_s=10)
    await rl.start_weight_update()
    await rl.update_weights(named)
    await rl.finish_weight_update(version)


async def check_spans(
    reply: GenerateReply, prompt: list[int], before, after, old: tuple[str, int], new: tuple[str, int]
) -> int:
    """The spans cover the tokens without a gap, name old then new weights, and the tokens are
    exactly a decode switched at their boundary; returns how many spans."""
    spans = reply.weight_versions
    n = len(reply.tokens)
    assert n == MAX_TOKENS and spans, reply
    assert spans[0].start == 0 and spans[-1].end == n
    assert all(a.end == b.start and a.start < a.end for a, b in zip(spans, spans[1:])), spans
    labels = [(s.version, s.seq) for s in spans]
    assert labels in ([old], [new], [old, new]), labels
    assert (reply.weight_version, reply.weight_seq) == labels[0], "the top-level version is the first token's"
    switch = spans[0].end if labels[0] == old else 0
    # off the event loop: the fleet's services share it
    local = await asyncio.to_thread(greedy_switched, before, after, prompt, n, switch, MODEL)
    assert reply.tokens == local, f"spans {spans}"
    return len(spans)


async def test_a_request_in_flight_across_a_commit_names_both_weight_sets_where_they_switched(fleet):
    f, rl = fleet
    before = engine_snapshot(f.workers["w0"].engine)
    info = await rl.get_weight_version_info()
    old = (info.version, info.seq)
    pushed, version = trained(71, MODEL), new_version("spans")
    await rl.init_weight_transfer(timeout_s=10)
    await rl.start_weight_update()
    await rl.update_weights(pushed)
    tasks = long_requests(rl)
    await eventually(lambda: in_flight(f) == len(PROMPTS), what="every request decoding")

    await rl.finish_weight_update(version)  # no pause: it lands between two steps of each request
    replies = await asyncio.gather(*tasks)

    new = (version, (await rl.get_weight_version_info()).seq)
    assert new[1] == old[1] + 1
    counts = [await check_spans(r, p, before, pushed, old, new) for r, p in zip(replies, PROMPTS)]
    assert 2 in counts, f"no request straddled the commit: {counts}"


async def test_requests_frozen_by_pause_keep_across_a_push_name_the_old_and_the_new_weights(fleet):
    f, rl = fleet
    before = engine_snapshot(f.workers["w0"].engine)
    info = await rl.get_weight_version_info()
    old = (info.version, info.seq)
    tasks = long_requests(rl)
    await eventually(lambda: in_flight(f) == len(PROMPTS), what="every request decoding")
    await rl.pause("keep")
    assert not any(t.done() for t in tasks)

    pushed, version = trained(72, MODEL), new_version("kept")
    await push_explicitly(rl, pushed, version)
    await rl.resume()
    replies = await asyncio.gather(*tasks)

    new = (version, old[1] + 1)
    counts = [await check_spans(r, p, before, pushed, old, new) for r, p in zip(replies, PROMPTS)]
    assert 2 in counts, f"no frozen request resumed on the new weights: {counts}"


async def test_a_reply_from_one_set_of_weights_has_one_span_naming_them(fleet):
    f, rl = fleet
    info = await rl.get_weight_version_info()
    reply = await rl.generate(PROMPTS[0], 12)
    assert [(s.version, s.seq, s.start, s.end) for s in reply.weight_versions] == [(info.version, info.seq, 0, 12)]
    assert (reply.weight_version, reply.weight_seq) == (info.version, info.seq)
