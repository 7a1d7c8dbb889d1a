"""rl.generate: generation on the reference engine (queue group across workers)."""

from __future__ import annotations

from typing import Literal

import msgspec

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
    request_id: str | None = None
    """Names the request across its sends. A client sends it again when its link to NATS came
    back (a reply sent meanwhile is lost): the worker that runs or lately ran that id answers
    with that run's reply; another worker runs it afresh. The SDK sets one on every request."""


class WeightVersionSpan(msgspec.Struct, frozen=True, kw_only=True):
    """Output tokens `[start, end)` were produced by the weights labelled `version` under commit
    `seq` (vLLM's `WeightVersionSpan(version, start, end)`, plus the seq)."""

    version: str
    """The weight version (VersionInfo.version) those tokens were produced under."""
    seq: int
    """Its commit sequence (VersionInfo.seq)."""
    start: int
    """Index of the span's first token in the reply's tokens."""
    end: int
    """One past its last token: spans cover the tokens in order, each starting where the last ended."""


class GenerateReply(Message, frozen=True, kw_only=True, tag="generate_reply"):
    worker_id: str
    tokens: list[int]
    """Generated tokens only (the prompt is not repeated)."""
    finish_reason: FinishReason
    """length: max_tokens reached; abort: ended by pause(mode="abort")."""
    weight_version: str
    """The weight version that produced the first token of this reply (every token, unless
    weight_versions has more than one span)."""
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
    weight_versions: list[WeightVersionSpan] = []
    """Which weights produced which tokens, in order, covering every token: one span when one
    set of weights produced them all, more when a commit (or a version relabel) landed while
    the request ran. Empty for a reply without tokens, or from a worker that predates it."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"
