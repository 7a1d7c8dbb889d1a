"""The Engine protocol: what a worker needs from whatever hosts the model.

The reference torch engine implements it (reference_engine.py); a vLLM adapter would map
each method onto vLLM's pause/sleep/weight-transfer calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec
import torch

from rlbus.schemas import GenerateReply, GenerateRequest, PauseMode, SleepTag, UpdateTarget
from rlbus.schemas.errors import InvalidArgument

from .book import Labels


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    paused: bool
    pause_mode: PauseMode | None
    sleeping_tags: list[SleepTag]
    sleep_level: int
    weights_loaded: bool
    in_flight: int
    waiting: int
    param_bytes: int
    kv_cache_bytes: int
    draft_stale: bool = False
    """The verifier was updated after the draft last was."""
    spec_proposed: int = 0
    """Draft tokens proposed since the engine started."""
    spec_accepted: int = 0
    """Draft tokens accepted since the engine started."""


class ParamSpec(msgspec.Struct, frozen=True):
    dtype: torch.dtype
    shape: tuple[int, ...]


class Engine(Protocol):
    """Everything here is called from the worker's event loop; long work must not block it.

    Refusals raise rlbus.schemas.errors subclasses (FailedPrecondition, InvalidArgument).
    """

    model_name: str
    sleep_mode_enabled: bool

    @property
    def has_draft_model(self) -> bool: ...

    @property
    def supports_draft_weight_updates(self) -> bool:
        """A draft exists, speculation is on and this engine can update the draft."""

    def attach(self, labels: Labels) -> None:
        """Label generated tokens from these books (the worker's own, read-only here)."""

    @property
    def recovering(self) -> bool:
        """The engine lost its weights (a failed load) and is bringing back the committed ones:
        the worker leaves the generate queue until it is done, then asks to be reconciled."""

    @property
    def num_params(self) -> int: ...

    def status(self) -> EngineStatus: ...

    async def generate(self, request: GenerateRequest) -> GenerateReply:
        """The reply with worker_id left empty (the worker service fills it in)."""

    async def pause(self, mode: PauseMode) -> None:
        """Returns once the pause is in effect (wait: in-flight requests finished)."""

    async def resume(self) -> None: ...

    async def sleep(self, level: int, tags: list[SleepTag]) -> None: ...

    async def wake_up(self, tags: list[SleepTag]) -> None: ...

    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]: ...

    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        """Live parameter tensors (receive in place into these)."""

    async def load_weights(
        self, target: UpdateTarget, tensors: Mapping[str, torch.Tensor], written: set[str] | None = None,
        *, loaded: Callable[[], None] = lambda: None,
    ) -> None:
        """Copy tensors into the model between forward steps. `written`: parameters already
        written in place (in_place mode); together they may complete a level-2 reload.
        `loaded()` is called once the new weights are in place and before any forward step
        runs on them (the worker records the commit there, so tokens are labelled by the
        weights that produced them); not at all if the load fails."""


def check_generate_request(req: GenerateRequest, *, vocab_size: int, max_len: int, max_len_name: str) -> None:
    """Refuse (INVALID_ARGUMENT) a request no engine can serve, before it takes a slot."""
    if not req.prompt_tokens:
        raise InvalidArgument("prompt_tokens is empty")
    bad = [t for t in req.prompt_tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if req.max_tokens < 1:
        raise InvalidArgument("max_tokens must be >= 1")
    if len(req.prompt_tokens) + req.max_tokens > max_len:
        raise InvalidArgument(
            f"prompt ({len(req.prompt_tokens)}) + max_tokens ({req.max_tokens}) exceeds {max_len_name} {max_len}"
        )
    if not req.temperature >= 0:
        raise InvalidArgument("temperature must be >= 0")
