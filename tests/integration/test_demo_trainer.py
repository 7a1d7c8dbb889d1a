"""The demo trainer against an in-process fleet: staleness filtering and determinism (the
task's pure rules are in tests/unit/test_demo_task.py)."""

from __future__ import annotations

from rlbus.models.tinylm import ModelConfig
from rlbus.runners.demo.run import draft_config
from rlbus.runners.demo.trainer import DemoConfig, Trainer
from tests.fleet import start_fleet

MODEL = ModelConfig(d_model=32, seed=0)


async def _run(url: str, prefix: str, **kw) -> list:
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
