"""Weight-update checks shared by test_weight_updates (over gloo and over shm) and the
process-fleet module, and the engine-level asserts of the unit tests (not a test file).

Each `check_*` coroutine runs one scenario against a fleet whose workers hold `MODEL`
and asserts everything the scenario promises; the modules call them with their own fleet.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import anyio
import msgspec
import pytest
import torch
from rlbus.schemas import FleetAck, UpdateWeights, VersionInfo
from rlbus.services.worker.reference_engine import ReferenceEngine

import rlbus
from rlbus.models.tinylm import KVCache, ModelConfig, TinyLM
from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from rlbus.transfer.stream import pack_all, prepare, send_all
from tests.fleet import PROMPTS, SMALL
from tests.waiting import eventually

MODEL = SMALL
MAX_TOKENS = 10
Named = list[tuple[str, torch.Tensor]]

_versions = itertools.count()


def new_version(tag: str = "v") -> str:
    """A version string no earlier push in this run used."""
    return f"{tag}-{next(_versions)}"


def trained(seed: int, cfg: ModelConfig = MODEL) -> Named:
    """A trainer's tensors: a TinyLM of the workers' shape, initialised from another seed."""
    model = TinyLM(msgspec.structs.replace(cfg, seed=seed))
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def engine_snapshot(engine: ReferenceEngine) -> dict[str, torch.Tensor]:
    """A copy of a reference engine's (main) parameters."""
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def assert_engine_holds(
    engine: ReferenceEngine, expected: Named | dict[str, torch.Tensor], who: str = "engine"
) -> None:
    """The engine's parameters are bit-identical to `expected` (same names, dtypes, shapes, bytes)."""
    want = dict(expected)
    have = dict(engine.model.named_parameters())
    assert set(have) == set(want), f"{who}: parameter names differ"
    differ = [n for n in want if not (have[n].dtype == want[n].dtype and torch.equal(have[n], want[n]))]
    assert not differ, f"{who}: parameters not bit-identical: {differ}"


def snapshot(fleet: LocalFleet, worker_id: str) -> dict[str, torch.Tensor]:
    """A copy of one in-process worker's parameters."""
    return engine_snapshot(fleet.workers[worker_id].engine)  # type: ignore[arg-type]


def assert_holds(fleet: LocalFleet, worker_id: str, expected: Named | dict[str, torch.Tensor]) -> None:
    """The worker's parameters are bit-identical to `expected` (same names, dtypes, shapes, bytes)."""
    assert_engine_holds(fleet.workers[worker_id].engine, expected, worker_id)  # type: ignore[arg-type]


@torch.inference_mode()
def greedy(
    named: Named | dict[str, torch.Tensor],
    prompts: Sequence[Sequence[int]] = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    cfg: ModelConfig = MODEL,
) -> list[list[int]]:
    """Greedy decode with a local TinyLM holding `named`, stepping like the reference engine
    (prefill the prompt, then one token at a time through the KV cache)."""
    model = TinyLM(cfg).eval()
    params = dict(model.named_parameters())
    for name, t in dict(named).items():
        params[name].data.copy_(t)
    out = []
    for prompt in prompts:
        kv = KVCache(cfg, 1)
        pending, pos, tokens = list(prompt), 0, []
        while len(tokens) < max_tokens:
            logits = model(torch.tensor(pending, dtype=torch.long), kv, 0, pos)[-1]
            token = int(torch.argmax(logits).item())
            pos += len(pending)
            pending = [token]
            tokens.append(token)
        out.append(tokens)
    return out


def greedy_switched(
    before: Named | dict[str, torch.Tensor],
    after: Named | dict[str, torch.Tensor],
    prompt: Sequence[int],
    max_tokens: int,
    switch_at: int,
    cfg: ModelConfig = MODEL,
) -> list[int]:
    """Greedy decode of one prompt that steps on `before` for its first `switch_at` tokens and
    on `after` from then on, keeping its KV cache across the switch: what a reference engine
    produces for a request in flight while new weights are loaded between two of its steps."""
    model = TinyLM(cfg).eval()
    params = dict(model.named_parameters())
    for name, t in dict(before).items():
        params[name].data.copy_(t)
    kv = KVCache(cfg, 1)
    pending, pos, tokens = list(prompt), 0, []
    with torch.inference_mode():
        while len(tokens) < max_tokens:
            if len(tokens) == switch_at:
                for name, t in dict(after).items():
                    params[name].data.copy_(t)
            logits = model(torch.tensor(pending, dtype=torch.long), kv, 0, pos)[-1]
            token = int(torch.argmax(logits).item())
            pos += len(pending)
            pending = [token]
            tokens.append(token)
    return tokens


async def generate_all(rl: RLClient, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = MAX_TOKENS):
    """One greedy generation per prompt; every reply ran to its length."""
    replies = await asyncio.gather(*(rl.generate(p, max_tokens) for p in prompts))
    assert all(r.finish_reason == "length" for r in replies)
    return replies


def tokens_of(replies) -> list[list[int]]:
    return [r.tokens for r in replies]


async def settle(rl: RLClient) -> None:
    """Leave the fleet as a test found it: no open session, awake, resumed."""
    info = await rl.server_info()
    if info.session_id:
        await rl.abort_weight_update("test cleanup")
    await rl.wake_up()
    await rl.resume()


@pytest.fixture(autouse=True)
async def settled(request):
    """Every test leaves the module's fleet with no session, awake and resumed (a module that
    imports this autouse fixture gets it around each of its tests)."""
    yield
    if "fleet" in request.fixturenames:
        _, rl = request.getfixturevalue("fleet")
        await settle(rl)


class VersionEvents:
    """Every message on `<prefix>.version`, decoded, in arrival order."""

    def __init__(self, rl: RLClient) -> None:
        self.rl = rl
        self.seen: list[VersionInfo] = []
        self._sub = None

    async def __aenter__(self) -> VersionEvents:
        decoder = msgspec.json.Decoder(VersionInfo)

        async def on(msg) -> None:
            self.seen.append(decoder.decode(msg.data))

        self._sub = await self.rl.nc.subscribe(self.rl.subjects.version, cb=on)
        await self.rl.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._sub is not None
        await self._sub.unsubscribe()

    async def wait_for(self, count: int) -> list[str]:
        await eventually(lambda: len(self.seen) >= count, what=f"{count} version events")
        return [v.version for v in self.seen]


async def first_watched_version(rl: RLClient) -> str:
    """The first value watch_versions() yields: the committed version as stored in KV."""
    agen = rl.watch_versions()
    try:
        with anyio.fail_after(10):
            return (await agen.__anext__()).version
    finally:
        await agen.aclose()


async def send_corrupted(rl: RLClient, named: Named, *, bucket_bytes: int, bad_bucket: int = 0) -> int:
    """In an open session: send the true metadata, then bytes whose bucket `bad_bucket` had
    one bit flipped after it was hashed; the true checksums go with finish, as the SDK's do.
    Returns how many buckets were sent."""
    plan = prepare(named, bucket_bytes)
    packed = pack_all(plan, named)
    await rl.call(UpdateWeights(params=plan.params, buckets=plan.buckets), FleetAck)
    packed.buffers[bad_bucket][7] ^= 0x10
    await anyio.to_thread.run_sync(send_all, rl.push.transfer, packed.buffers)
    rl.push.checksums += packed.checksums
    return len(packed.buffers)


def halves(named: Named) -> tuple[Named, Named]:
    mid = len(named) // 2
    return named[:mid], named[mid:]


async def received_everything(fleet: LocalFleet) -> None:
    """Every worker's open session finished receiving (staged or in place)."""

    def done() -> bool:
        sessions = [w.updates.session for w in fleet.workers.values()]
        return all(s is not None and s.receiving == 0 and s.done.is_set() for s in sessions)

    await eventually(done, what="every worker received the bytes")


# ---- scenarios shared by backends ----------------------------------------------------------


async def assert_no_session_recorded(fleet: LocalFleet) -> None:
    """KV records no open session, so a controller started next finds no orphan to abort."""
    assert fleet.controller is not None and fleet.controller.store is not None
    assert await fleet.controller.store.session() is None


async def check_push_weights_is_bit_identical(fleet: LocalFleet, rl: RLClient, seed: int) -> str:
    """push_weights -> bit-identical parameters everywhere, version committed and reported."""
    before = tokens_of(await generate_all(rl))
    named = trained(seed)
    version = new_version("push")

    ack = await rl.push_weights(named, version)

    assert ack.weight_version == version
    assert sorted(w.worker_id for w in ack.workers) == sorted(fleet.workers)
    for wid in fleet.workers:
        assert_holds(fleet, wid, named)
        assert fleet.workers[wid].book.main.version == version
    info = await rl.server_info()
    assert info.weight_version == version and info.session_id is None
    await assert_no_session_recorded(fleet)
    assert all(w.state.weight_version == version and not w.behind for w in info.workers)
    assert await rl.get_weight_version() == version
    assert await first_watched_version(rl) == version
    replies = await generate_all(rl)
    assert all(r.weight_version == version for r in replies)
    after = tokens_of(replies)
    assert after == greedy(named)
    assert after != before, "the pushed model should generate differently from the initial one"
    return version


async def check_explicit_lifecycle_in_two_updates(fleet: LocalFleet, rl: RLClient, seed: int) -> None:
    """init -> start -> update(first half) -> update(second half) -> finish(v); then a second
    session finished with None commits new weights under the same version string."""
    named = trained(seed)
    first, second = halves(named)
    version = new_version("explicit")

    init = await rl.init_weight_transfer(timeout_s=10)
    assert all(w.transfer_ready for w in init.workers)
    started = await rl.start_weight_update()
    assert started.session_id and all(w.session_id == started.session_id for w in started.workers)
    await rl.update_weights(first, bucket_bytes=4096)
    await rl.update_weights(second, bucket_bytes=4096)
    done = await rl.finish_weight_update(version)

    assert done.weight_version == version
    assert all(w.weight_version == version and w.session_id is None for w in done.workers)
    for wid in fleet.workers:
        assert_holds(fleet, wid, named)
    assert (await rl.server_info()).weight_version == version

    again = trained(seed + 1)
    await rl.start_weight_update()
    await rl.update_weights(again)
    kept = await rl.finish_weight_update(None)

    assert kept.weight_version == version
    for wid in fleet.workers:
        assert_holds(fleet, wid, again)
        assert fleet.workers[wid].book.main.version == version
    assert await rl.get_weight_version() == version
    assert tokens_of(await generate_all(rl)) == greedy(again)


async def check_corrupted_bytes_abort_the_finish(fleet: LocalFleet, rl: RLClient, seed: int) -> None:
    """A bucket whose bytes do not match its checksum: finish is ABORTED naming every worker,
    nothing changes, nothing is published, and the next push succeeds."""
    old = {w: snapshot(fleet, w) for w in fleet.workers}
    before = tokens_of(await generate_all(rl))
    old_version = (await rl.server_info()).weight_version
    named = trained(seed)
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)

    async with VersionEvents(rl) as events:
        await rl.start_weight_update()
        await send_corrupted(rl, named, bucket_bytes=4096, bad_bucket=1)
        with pytest.raises(rlbus.Aborted) as err:
            await rl.finish_weight_update("bad")

        assert err.value.code == "ABORTED"
        assert sorted(err.value.workers) == sorted(fleet.workers)
        assert "checksum" in err.value.message
        for wid in fleet.workers:
            assert_holds(fleet, wid, old[wid])
            assert fleet.workers[wid].book.main.version == old_version
            assert fleet.workers[wid].updates.session is None
        info = await rl.server_info()
        assert info.weight_version == old_version and info.session_id is None
        await assert_no_session_recorded(fleet)
        assert await first_watched_version(rl) == old_version
        assert tokens_of(await generate_all(rl)) == before

        good = new_version("after-bad")
        await rl.push_weights(named, good)
        # one publisher, one connection: had "bad" been published, it would arrive first
        assert await events.wait_for(1) == [good]
    for wid in fleet.workers:
        assert_holds(fleet, wid, named)


async def check_shape_mismatch_is_refused_before_bytes_move(fleet: LocalFleet, rl: RLClient, seed: int) -> None:
    """One tensor of the wrong shape: INVALID_ARGUMENT naming it; nothing changes; the open
    session still takes a correct update; push_weights with the bad tensor leaves no session."""
    old = {w: snapshot(fleet, w) for w in fleet.workers}
    named = trained(seed)
    victim = "blocks.1.fc1.weight"
    bad = [(n, torch.zeros(t.shape[0] + 1, *t.shape[1:]) if n == victim else t) for n, t in named]
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)

    await rl.start_weight_update()
    with pytest.raises(rlbus.InvalidArgument) as err:
        await rl.update_weights(bad)
    assert err.value.code == "INVALID_ARGUMENT"
    assert victim in err.value.message
    assert sorted(err.value.workers) == sorted(fleet.workers)
    for wid in fleet.workers:
        assert_holds(fleet, wid, old[wid])
        assert not fleet.workers[wid].updates.session.received, "no byte may move after a refused check"  # type: ignore[union-attr]
    assert (await rl.server_info()).session_id is not None, "a refused check leaves the session open"

    version = new_version("after-shape")
    await rl.update_weights(named)
    await rl.finish_weight_update(version)
    for wid in fleet.workers:
        assert_holds(fleet, wid, named)

    with pytest.raises(rlbus.InvalidArgument) as err:
        await rl.push_weights(bad, new_version("never"))
    assert victim in err.value.message
    info = await rl.server_info()
    assert info.session_id is None and info.weight_version == version
    assert not await rl.is_paused()
    for wid in fleet.workers:
        assert_holds(fleet, wid, named)


async def check_staged_abort_keeps_generation(fleet: LocalFleet, rl: RLClient, seed: int) -> None:
    """staged: every byte arrived, then abort -> old weights, old version, same output as before."""
    old = {w: snapshot(fleet, w) for w in fleet.workers}
    old_version = (await rl.server_info()).weight_version
    before = tokens_of(await generate_all(rl))
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)

    await rl.start_weight_update()
    await rl.update_weights(trained(seed))
    await received_everything(fleet)
    aborted = await rl.abort_weight_update("changed my mind")

    assert all(w.session_id is None and not w.dirty for w in aborted.workers)
    for wid in fleet.workers:
        assert_holds(fleet, wid, old[wid])
    assert await rl.get_weight_version() == old_version
    replies = await generate_all(rl)
    assert tokens_of(replies) == before
    assert all(r.weight_version == old_version for r in replies)


async def check_level_2_sleep_then_push(fleet: LocalFleet, rl: RLClient, seed: int) -> None:
    """The vLLM RL flow: sleep(2) -> wake(weights) -> update -> wake(kv_cache) -> generate."""
    named = trained(seed)
    version = new_version("after-sleep")
    await rl.pause("wait")
    await rl.sleep(level=2)
    awake = await rl.wake_up(["weights"])
    assert all(w.sleeping_tags == ["kv_cache"] and not w.weights_loaded for w in awake.workers)

    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=10)
    await rl.start_weight_update()
    await rl.update_weights(named)
    done = await rl.finish_weight_update(version)
    assert all(w.weights_loaded and w.weight_version == version for w in done.workers)
    with pytest.raises(rlbus.FailedPrecondition):  # kv_cache still asleep
        await rl.generate([1, 2, 3], 2, timeout=10)

    await rl.wake_up(["kv_cache"])
    await rl.resume()
    for wid in fleet.workers:
        assert_holds(fleet, wid, named)
    replies = await generate_all(rl)
    assert tokens_of(replies) == greedy(named)
    assert all(r.weight_version == version for r in replies)
