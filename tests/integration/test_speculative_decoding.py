"""Draft models as first-class update targets: acceptance you can see, drafts kept fresh."""

from __future__ import annotations

import msgspec
import pytest
import torch
from rlbus.services.worker.reference_engine import ReferenceEngine

import rlbus
from rlbus.models.tinylm import TinyLM
from tests.fleet import SMALL, start_fleet

PROMPTS = [[1, 2, 3], [5, 9], [7, 7, 7, 7], [11, 30, 2], [40, 41]]


def _model(seed: int) -> TinyLM:
    return TinyLM(msgspec.structs.replace(SMALL, seed=seed))


def _params(engine: ReferenceEngine, target: str) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.parameters_of(target).items()}  # type: ignore[arg-type]


async def _acceptance(rl) -> tuple[float, list[list[int]]]:
    proposed = accepted = 0
    outputs = []
    for p in PROMPTS:
        r = await rl.generate(p, 24)
        proposed += r.proposed
        accepted += r.accepted
        outputs.append(r.tokens)
    assert proposed > 0, "speculation did not run"
    return accepted / proposed, outputs


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    fleet, rl = await start_fleet(
        nats_server.url,
        prefix,
        weight_transfer_backend="gloo",
        engine_kw={"draft_config": SMALL, "num_speculative_tokens": 4},
    )
    await rl.init_weight_transfer(timeout_s=20)
    yield fleet, rl
    await rl.close()
    await fleet.close()


async def test_a_draft_identical_to_the_verifier_is_accepted_almost_always(fleet):
    f, rl = fleet
    info = await rl.server_info()
    assert info.capabilities.has_draft_model and info.capabilities.supports_draft_weight_updates
    rate, _ = await _acceptance(rl)
    assert rate > 0.95


async def test_speculative_output_equals_the_verifier_alone(fleet):
    f, rl = fleet
    plain = ReferenceEngine(SMALL)  # same seed: the verifier's weights
    engine = next(iter(f.workers.values())).engine
    plain.model.load_state_dict(engine.model.state_dict())
    _, outputs = await _acceptance(rl)
    for p, out in zip(PROMPTS, outputs):
        alone = await plain.generate(rlbus.schemas.GenerateRequest(prompt_tokens=p, max_tokens=24))
        assert out == alone.tokens


async def test_a_stale_draft_loses_acceptance_and_a_pushed_draft_recovers_it(fleet):
    f, rl = fleet
    new_policy = _model(seed=11)
    await rl.push_weights(new_policy.named_parameters(), version="policy-1")
    info = await rl.server_info()
    assert all(w.state.draft_stale for w in info.workers)
    stale_rate, _ = await _acceptance(rl)
    assert stale_rate < 0.5

    ack = await rl.push_weights(new_policy.named_parameters(), version="draft-1", draft=True)
    assert all(w.draft_version == "draft-1" and not w.draft_stale for w in ack.workers)
    info = await rl.server_info()
    assert info.draft_version == "draft-1" and info.weight_version == "policy-1"
    fresh_rate, _ = await _acceptance(rl)
    assert fresh_rate > 0.95 and fresh_rate > stale_rate + 0.4


async def test_draft_updates_leave_the_verifier_bit_identical_and_vice_versa(fleet):
    f, rl = fleet
    engines = [w.engine for w in f.workers.values()]
    main_before = [_params(e, "main") for e in engines]
    draft_model = _model(seed=21)
    await rl.push_weights(draft_model.named_parameters(), version="draft-2", draft=True)
    for e, before in zip(engines, main_before):
        assert all(torch.equal(before[n], t) for n, t in e.parameters_of("main").items())
        assert all(torch.equal(dict(draft_model.named_parameters())[n], t) for n, t in e.parameters_of("draft").items())

    draft_before = [_params(e, "draft") for e in engines]
    main_model = _model(seed=22)
    await rl.push_weights(main_model.named_parameters(), version="policy-2")
    for e, before in zip(engines, draft_before):
        assert all(torch.equal(before[n], t) for n, t in e.parameters_of("draft").items())
    assert (await rl.get_weight_version()) == "policy-2"
    assert (await rl.server_info()).draft_version == "draft-2"


async def test_level_2_sleep_and_wake_keep_the_drafts_acceptance(fleet):
    f, rl = fleet
    policy = _model(seed=31)
    await rl.push_weights(policy.named_parameters(), version="policy-3")
    await rl.push_weights(policy.named_parameters(), version="draft-3", draft=True)
    before, outputs_before = await _acceptance(rl)

    await rl.pause("wait")
    await rl.sleep(level=2)
    await rl.wake_up(tags=["weights"])
    await rl.start_weight_update()  # the verifier reload of the vLLM flow; no draft push
    await rl.update_weights(policy.named_parameters())
    await rl.finish_weight_update()
    await rl.wake_up(tags=["kv_cache"])
    await rl.resume()

    after, outputs_after = await _acceptance(rl)
    assert after == pytest.approx(before, abs=0.02)
    assert outputs_after == outputs_before


async def test_draft_update_is_refused_where_a_worker_has_no_draft(nats_server, prefix):
    f, rl = await start_fleet(nats_server.url, prefix + "nd", weight_transfer_backend="gloo")
    try:
        with pytest.raises(rlbus.FailedPrecondition, match="draft"):
            await rl.start_draft_weight_update()
        assert (await rl.server_info()).session_id is None
    finally:
        await rl.close()
        await f.close()


async def test_a_backend_that_cannot_update_drafts_is_refused_before_anything_starts(nats_server, prefix):
    f, rl = await start_fleet(
        nats_server.url,
        prefix + "nb",
        weight_transfer_backend="gloo",
        engine_kw={"draft_config": SMALL, "draft_updates_supported": False},
    )
    try:
        info = await rl.server_info()
        assert info.capabilities.has_draft_model and not info.capabilities.supports_draft_weight_updates
        with pytest.raises(rlbus.FailedPrecondition) as e:
            await rl.start_draft_weight_update()
        assert set(e.value.message.split("[")[1].split("]")[0].replace("'", "").split(", ")) == {"w0", "w1"}
    finally:
        await rl.close()
        await f.close()


async def test_the_disable_policy_turns_speculation_off_while_the_draft_is_stale(nats_server, prefix):
    f, rl = await start_fleet(
        nats_server.url,
        prefix + "sp",
        weight_transfer_backend="gloo",
        engine_kw={"draft_config": SMALL, "stale_draft_policy": "disable"},
    )
    try:
        assert (await rl.generate([1, 2, 3], 16)).proposed > 0
        policy = _model(seed=41)
        await rl.push_weights(policy.named_parameters(), version="p1")
        stale = await rl.generate([1, 2, 3], 16)
        assert stale.proposed == 0 and len(stale.tokens) == 16
        await rl.push_weights(policy.named_parameters(), version="d1", draft=True)
        fresh = await rl.generate([1, 2, 3], 16)
        assert fresh.proposed > 0 and fresh.acceptance_rate > 0.95
        assert fresh.tokens == stale.tokens, "speculation never changes greedy output"
    finally:
        await rl.close()
        await f.close()
