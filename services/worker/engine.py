"""The engine base class: what a worker needs from whatever hosts the model, and the lifecycle
every engine shares.

`Engine` holds, once, what every engine does the same way (as vLLM's `WeightTransferEngine`
base holds what every transport shares): pause modes and their idempotency, sleep levels and
tags, new requests waiting for resume, status, the refusals of an unservable engine, and the
books that label its tokens. A subclass implements its model calls: generate, the pause,
resume, sleep and wake hooks (`_on_*`), the parameter specs and tensors, and load_weights.
Implementations: the reference TinyLM engine (reference_engine.py), vLLM's AsyncLLM
(vllm/engine.py) and the benchmarks' weightless engine (bench/weightless.py).
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import torch
from rlbus.schemas import (
    SLEEP_TAGS,
    BucketMeta,
    FleetState,
    GenerateReply,
    GenerateRequest,
    ParamMeta,
    PauseMode,
    SleepTag,
    TensorChecksum,
    TransferInit,
    UpdateTarget,
    WeightVersionSpan,
)
from rlbus.schemas.errors import FailedPrecondition, InvalidArgument, Unavailable

from .book import Book, Labels, WeightLabel
from .changes import Changes

PAUSE_MODES = frozenset(typing.get_args(PauseMode))


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


class TokenLabels:
    """Which weights produced each token of one request, as spans: an engine adds each run of
    tokens with the label of the weights that produced it (read at that step, from the books)."""

    def __init__(self, admitted: WeightLabel) -> None:
        self._first = admitted
        """The label when the request was admitted: a reply without tokens carries it."""
        self._spans: list[tuple[WeightLabel, int, int]] = []

    def add(self, label: WeightLabel, count: int) -> None:
        if count <= 0:
            return
        end = self._spans[-1][2] if self._spans else 0
        if self._spans and self._spans[-1][0] == label:
            self._spans[-1] = (label, self._spans[-1][1], end + count)
        else:
            self._spans.append((label, end, end + count))

    def reply_fields(self, n: int) -> dict[str, Any]:
        """weight_version, weight_seq (the first token's) and weight_versions for a reply of `n` tokens."""
        spans = [
            WeightVersionSpan(version=label.version, seq=label.seq, start=start, end=min(end, n))
            for label, start, end in self._spans
            if start < n
        ]
        first = self._spans[0][0] if spans else self._first
        return {"weight_version": first.version, "weight_seq": first.seq, "weight_versions": spans}


class EngineReceiver(Protocol):
    """The data plane of an engine whose own processes receive, verify and load the bytes
    (vLLM's worker processes, one transfer rank each). The worker's WeightUpdates keeps the
    session, its books and every check before a byte moves, and hands it the rest. Failures of
    the data plane raise rlbus.transfer's TransferError; nothing here blocks the loop."""

    async def join(self, init: TransferInit, rank: int) -> None:
        """Join the group as `rank` (and the following ranks, one per engine process)."""
        ...

    def leave(self, group_name: str) -> None:
        """Leave that group at once (a receive in it fails)."""
        ...

    def holds(self, group_name: str) -> bool:
        """The engine's processes are still in that group (a restarted engine lost it)."""
        ...

    async def receive(
        self,
        session_id: str,
        target: UpdateTarget,
        params: Sequence[ParamMeta],
        buckets: Sequence[BucketMeta],
        *,
        in_place: bool = False,
    ) -> None:
        """Receive one update's buckets (checked already); returns when every bucket arrived.
        ``in_place``: into the engine's committed copy (no staged copy; torn if the session
        does not commit)."""
        ...

    async def verify(
        self, session_id: str, checksums: Sequence[str], tensor_checksums: Sequence[TensorChecksum]
    ) -> str | None:
        """Phase 1 of finish where the bytes are: why the session fails, or None."""
        ...

    async def commit(
        self, session_id: str, target: UpdateTarget, version: str | None, loaded: Callable[[], None]
    ) -> None:
        """Phase 2: load the verified session into the model, the engine taking `version` in
        the same load (None: it keeps its version string); `loaded()` as in load_weights."""
        ...

    def abort(self, session_id: str) -> None:
        """Drop the session's bytes at once."""
        ...


class NotStarted(Unavailable):
    """A new request the engine held (paused, or waiting for the model) and never started, ended
    because the worker stops (Engine.hand_back): nothing of it ran, so it may run elsewhere."""


class Engine(abc.ABC):
    """Everything here is called from the worker's event loop; long work must not block it.

    Refusals raise rlbus.schemas.errors subclasses (FailedPrecondition, InvalidArgument,
    Unavailable). The worker's books are read here (to label tokens), never written: a commit
    reaches them through the `loaded` callback of load_weights.
    """

    sleeps_tags_together = False
    """The engine sleeps weights and KV cache only together (vLLM): sleep refuses a subset."""
    sleep_off_hint = "start it with --enable-sleep-mode"
    """How to turn sleep mode on, for the refusal when it is off."""
    transfer_ranks = 1
    """Ranks the engine takes in a transfer group (its receiving processes; vLLM: its TP ranks)."""
    receiver: EngineReceiver | None = None
    """Set when the engine's own processes receive the bytes (then load_weights gets no
    tensors: it loads what the receiver verified)."""

    def __init__(self, model_name: str, *, sleep_mode_enabled: bool) -> None:
        self.model_name = model_name
        self.sleep_mode_enabled = sleep_mode_enabled
        self.book: Labels = Book()
        """Where tokens get their labels: the worker's books once it attaches them."""
        self.draft_stale = False
        """The verifier was updated after the draft last was."""
        self.spec_proposed = 0
        self.spec_accepted = 0
        self._paused = False
        self._pause_mode: PauseMode | None = None
        self._sleeping: set[SleepTag] = set()
        self._sleep_level = 0
        self._waiting = 0
        """New requests held before the model (paused, or whatever else `_wait_until_open` waits for)."""
        self._handing_back = False
        """The worker stops: new requests end with NotStarted rather than wait (hand_back)."""
        self._changes = Changes()

    def attach(self, labels: Labels) -> None:
        """Label generated tokens from these books (the worker's own)."""
        self.book = labels

    # ---- capabilities (override what differs) ------------------------------------------------

    @property
    def has_draft_model(self) -> bool:
        return False

    @property
    def supports_draft_weight_updates(self) -> bool:
        """A draft exists, speculation is on and this engine can update the draft."""
        return False

    @property
    def recovering(self) -> bool:
        """The engine lost its weights (a failed load) and is bringing back the committed ones:
        the worker leaves the generate queue until it is done, then asks to be reconciled."""
        return False

    @property
    def weights_loaded(self) -> bool:
        """False once a level-2 sleep discarded the weights, until a load brings them back."""
        return True

    @property
    @abc.abstractmethod
    def num_params(self) -> int: ...

    @property
    def param_bytes(self) -> int:
        return 0

    @property
    def kv_cache_bytes(self) -> int:
        return 0

    def _active(self) -> int:
        """Requests the model holds (running, frozen, or queued inside it): sleep refuses them."""
        return 0

    def _in_flight(self) -> int:
        """Requests the model runs without a resume (status.in_flight)."""
        return self._active()

    def requests_in_flight(self) -> int:
        """status().in_flight alone, without building the rest of the status."""
        return self._in_flight()

    def _held_back(self) -> int:
        """Requests queued inside the model behind a pause (counted as waiting)."""
        return 0

    # ---- status --------------------------------------------------------------------------

    def stance(self) -> FleetState:
        """Where the engine stands, as the target a command changes one part of: paused (in which
        mode) or running, and which parts sleep at which level. The part of status() that pause,
        resume, sleep and wake read, without building the rest (once per command)."""
        return FleetState(
            paused=self._paused,
            pause_mode=self._pause_mode,
            sleep_level=self._sleep_level,
            sleeping_tags=[t for t in SLEEP_TAGS if t in self._sleeping] if self._sleeping else [],
        )

    def status(self) -> EngineStatus:
        return EngineStatus(
            paused=self._paused,
            pause_mode=self._pause_mode,
            sleeping_tags=[t for t in SLEEP_TAGS if t in self._sleeping] if self._sleeping else [],
            sleep_level=self._sleep_level,
            weights_loaded=self.weights_loaded,
            in_flight=self._in_flight(),
            waiting=self._waiting + self._held_back(),
            param_bytes=self.param_bytes,
            kv_cache_bytes=self.kv_cache_bytes,
            draft_stale=self.draft_stale,
            spec_proposed=self.spec_proposed,
            spec_accepted=self.spec_accepted,
        )

    # ---- generation ----------------------------------------------------------------------

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateReply:
        """The reply with worker_id left empty (the worker service fills it in)."""

    def _refuse_if_unservable(self) -> None:
        if self.recovering:
            raise Unavailable(
                "the engine failed to load weights and is restarting from the last committed weights "
                f"({self.book.main.version}); retry"
            )
        if self._sleeping:
            asleep = ", ".join(sorted(self._sleeping))
            raise FailedPrecondition(f"engine is asleep ({asleep}); call wake_up() before generating")
        if not self.weights_loaded:
            raise FailedPrecondition("weights were discarded by a level-2 sleep; push new weights before generating")
        if self.book.dirty:
            raise FailedPrecondition("weights are half-updated after an aborted in-place update; push weights again")

    async def _wait_until_open(self, blocked: Callable[[], bool] = lambda: False) -> None:
        """New requests wait for resume in every pause mode (and while `blocked()`), then are
        checked again: the engine may have gone to sleep meanwhile. Once the worker stops
        (hand_back), one still waiting, or arriving, raises NotStarted instead."""
        self._refuse_if_handed_back()
        if not self._paused and not blocked():
            return
        self._waiting += 1
        self._changes.notify()
        try:
            await self._changes.until(lambda: self._handing_back or (not self._paused and not blocked()))
        finally:
            self._waiting -= 1
            self._changes.notify()
        self._refuse_if_handed_back()
        self._refuse_if_unservable()

    def hand_back(self) -> None:
        """The worker stops: every new request held here and not started (arrived while paused,
        or waiting for the model) ends at once with NotStarted, and so does any that comes after,
        so that its caller can send it to another worker (a drain waits only for what runs).
        For good: the engine of a stopped worker takes no new request after it."""
        self._handing_back = True
        self._changes.notify()

    def _refuse_if_handed_back(self) -> None:
        if self._handing_back:
            raise NotStarted("the worker is stopping: the request was not started here; send it again")

    # ---- pause / resume ------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        """Returns once the pause is in effect (wait: in-flight requests finished; keep: they
        are frozen). Idempotent; a second abort still ends frozen requests."""
        if mode not in PAUSE_MODES:  # the wire decoder refuses it; a direct caller may not
            raise InvalidArgument(f"unknown pause mode {mode!r}; use abort, wait or keep")
        if self._paused and mode != "abort":
            return
        self._paused = True
        if mode == "abort" or self._pause_mode is None:
            self._pause_mode = mode
        self._changes.notify()
        await self._on_pause(mode)

    async def resume(self) -> None:
        if not self._paused:
            return
        await self._on_resume()
        self._paused = False
        self._pause_mode = None
        self._changes.notify()

    async def _on_pause(self, mode: PauseMode) -> None:
        """Bring the model's requests to the pause: abort ends them, wait lets them finish, keep
        freezes them; return once that holds. New requests already wait."""

    async def _on_resume(self) -> None:
        """The model may run again (frozen requests go on); called before new requests are let in."""

    # ---- sleep / wake --------------------------------------------------------------------

    async def sleep(self, level: int, tags: list[SleepTag]) -> None:
        if not self.sleep_mode_enabled:
            raise FailedPrecondition(f"sleep mode is off on this worker; {self.sleep_off_hint}")
        if level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2, not {level}")
        if busy := self._active():
            raise FailedPrecondition(
                f"{busy} requests are in flight; pause with mode='abort' or 'wait' before sleeping"
            )
        if self.sleeps_tags_together and set(tags) != set(SLEEP_TAGS):
            raise FailedPrecondition("this engine sleeps weights and KV cache together; sleep with tags=None (both)")
        todo = [t for t in SLEEP_TAGS if t in tags and t not in self._sleeping]
        if not todo:
            return
        await self._on_sleep(level, todo)
        self._sleeping |= set(todo)
        self._sleep_level = max(self._sleep_level, level)
        self._changes.notify()

    async def wake_up(self, tags: list[SleepTag]) -> None:
        todo = [t for t in SLEEP_TAGS if t in tags and t in self._sleeping]
        if not todo:
            return
        await self._on_wake(todo)
        self._sleeping -= set(todo)
        if not self._sleeping:
            self._sleep_level = 0
        self._changes.notify()

    async def _on_sleep(self, level: int, tags: list[SleepTag]) -> None:
        """Free `tags` (none of them asleep yet): level 1 keeps the weights on the host, level 2
        discards them (weights_loaded turns False)."""

    async def _on_wake(self, tags: list[SleepTag]) -> None:
        """Bring `tags` back (all of them asleep; the sleep level is still the one they slept at)."""

    # ---- weights -------------------------------------------------------------------------

    @abc.abstractmethod
    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]: ...

    @abc.abstractmethod
    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        """Live parameter tensors (receive in place into these)."""

    async def live_checksum(self, target: UpdateTarget) -> str:
        """One hash of the model this engine computes with, where that is not `parameters_of`
        (vLLM: its own repacked layout, in its own processes); "" where it is."""
        return ""

    @abc.abstractmethod
    async def load_weights(
        self,
        target: UpdateTarget,
        tensors: Mapping[str, torch.Tensor],
        written: set[str] | None = None,
        *,
        loaded: Callable[[], None] = lambda: None,
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
