"""rl.generate: generation on the reference engine (queue group across workers)."""

from __future__ import annotations

from typing import Literal

from .base import Message

FinishReason = Literal["length", "abort"]


class GenerateRequest(Message, frozen=True, kw_only=True, tag="generate"):
    prompt_tokens: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    """0 = greedy."""
    seed: int | None = None
    """Sampling seed (temperature > 0); same seed, same weights -> same tokens."""
    return_logprobs: bool = False


class GenerateReply(Message, frozen=True, kw_only=True, tag="generate_reply"):
    worker_id: str
    tokens: list[int]
    """Generated tokens only (the prompt is not repeated)."""
    finish_reason: FinishReason
    """length: max_tokens reached; abort: ended by pause(mode="abort")."""
    weight_version: str
    """The weight version that produced every token of this reply."""
    weight_seq: int = 0
    """Its commit sequence (VersionInfo.seq): how stale a rollout is, by subtraction."""
    draft_version: str | None = None
    logprobs: list[float] | None = None
    proposed: int = 0
    """Draft tokens proposed (speculative decoding)."""
    accepted: int = 0
    """Draft tokens accepted by the verifier."""
    mean_accepted_length: float = 0.0
    """Accepted draft tokens per verifier step (0 without speculation)."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"
