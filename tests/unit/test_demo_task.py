"""The demo's task alone, no NATS: which rollouts are too stale to train on, and the reward."""

from __future__ import annotations

from rlbus.schemas import GenerateReply

from rlbus.runners.demo.task import Task, split_by_staleness, version_step


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
