"""The demo's task: emit tokens from a target band. Rewards, prompts, staleness."""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from rlbus.schemas import GenerateReply


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """Reward = the fraction of generated tokens inside [low, low + width).

    A random policy over a vocabulary of V scores width / V; a policy that learned the
    band scores 1.0, so the curve has room to rise within a few dozen steps.
    """

    vocab_size: int = 64
    low: int = 8
    width: int = 8
    prompt_len: int = 4
    response_len: int = 12

    def prompts(self, rng: random.Random, n: int) -> list[list[int]]:
        return [[rng.randrange(self.vocab_size) for _ in range(self.prompt_len)] for _ in range(n)]

    def reward(self, tokens: Sequence[int]) -> float:
        if not tokens:
            return 0.0
        return sum(self.low <= t < self.low + self.width for t in tokens) / len(tokens)


def version_step(version: str) -> int:
    """`step-N` -> N; anything else (e.g. "default") is step 0."""
    head, _, tail = version.rpartition("-")
    return int(tail) if head == "step" and tail.isdigit() else 0


def split_by_staleness(
    replies: Sequence[GenerateReply], current_step: int, max_staleness: int
) -> tuple[list[GenerateReply], list[GenerateReply]]:
    """(fresh, dropped): a rollout is dropped when its weights are more than
    `max_staleness` versions older than the trainer's current ones."""
    fresh: list = []
    dropped: list = []
    for r in replies:
        (fresh if current_step - version_step(r.weight_version) <= max_staleness else dropped).append(r)
    return fresh, dropped
