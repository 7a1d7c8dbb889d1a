"""The demo trainer against an in-process fleet: staleness filtering and determinism."""

from __future__ import annotations

import msgspec

from rlbus.runners.demo.run import draft_config
from rlbus.runners.demo.task import Task, split_by_staleness, version_step
from rlbus.runners.demo.trainer import DemoConfig, Trainer
from rlbus.schemas import GenerateReply
from rlbus.models.tinylm import ModelConfig
from tests.fleet import start_fleet

MODEL = ModelConfig(d_model=32, seed=0)


def _reply(version: str) -> GenerateReply:
    return GenerateReply(worker_id="w", tokens=[1], finish_reason="length", weight_version=version)


def test_rollouts_older_than_max_staleness_are_dropped():
    replies = [_reply("default"), _reply("step-3"), _reply("step-4"), _reply("step-5")]
    fresh, dropped = split_by_staleness(replies, current_step=5, max_staleness=1)
    assert [r.weight_version for r in fresh] == ["step-4", "step-5"]
    assert [r.weight_version for r in dropped] == ["default", "step-3"]
    fresh, dropped = split_by_staleness(replies, current_step=5, max_staleness=0)
    assert [r.weight_version for r in fresh] == ["step-5"]
    assert version_step("default") == 0 and version_step("step-12") == 12


def test_reward_counts_tokens_in_the_band():
    task = Task(low=8, width=8)
    assert task.reward([8, 15, 16, 0]) == 0.5
    assert task.reward([]) == 0.0


async def _run(url: str, prefix: str, **kw) -> list:  # noqa: ANN003
    fleet, rl = await start_fleet(
        url, prefix, model=MODEL, weight_transfer_backend="gloo", engine_kw={"draft_config": draft_config(MODEL)}
    )
    try:
        cfg = DemoConfig(steps=3, model=MODEL, draft_model=draft_config(MODEL), draft_every=2, **kw)
        return await Trainer(rl, cfg).run()
    finally:
        await rl.close()
        await fleet.close()


async def test_async_rollouts_one_version_old_are_dropped_when_strictly_on_policy(nats_server, prefix):
    logs = await _run(nats_server.url, prefix + "a", max_staleness=0, async_rollouts=True)
    # steps 2 and 3 trained on rollouts generated during the previous step: one version old
    assert logs[0].dropped == 0
    assert all(g.dropped == g.regenerated > 0 for g in logs[1:])
    assert [g.version for g in logs] == ["step-1", "step-2", "step-3"]


async def test_the_same_seed_gives_the_same_reward_curve(nats_server, prefix):
    a = await _run(nats_server.url, prefix + "b", max_staleness=1, seed=5)
    b = await _run(nats_server.url, prefix + "c", max_staleness=1, seed=5)
    assert [g.reward for g in a] == [g.reward for g in b]
    assert [g.eval_reward for g in a] == [g.eval_reward for g in b]
    assert all(g.dropped == 0 for g in a)
