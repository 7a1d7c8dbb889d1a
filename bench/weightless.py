"""WeightlessEngine: the Engine protocol with no model, for control-plane benchmarks.

Every call keeps the state a real engine would report (paused, pause mode, sleeping tags,
versions) and costs nothing else, so a benchmark built on it measures rlbus, not torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from rlbus.schemas import GenerateReply, GenerateRequest, PauseMode, SleepTag, UpdateTarget
from rlbus.services.worker.book import Book, Labels
from rlbus.services.worker.engine import EngineStatus, ParamSpec


class WeightlessEngine:
    """Implements rlbus.services.worker.engine.Engine; holds no parameters."""

    def __init__(self, model_name: str = "weightless", *, sleep_mode_enabled: bool = True) -> None:
        self.model_name = model_name
        self.sleep_mode_enabled = sleep_mode_enabled
        self.book: Labels = Book()
        self._paused = False
        self._pause_mode: PauseMode | None = None
        self._sleeping: list[SleepTag] = []
        self._sleep_level = 0

    def attach(self, labels: Labels) -> None:
        self.book = labels

    @property
    def recovering(self) -> bool:
        return False

    @property
    def has_draft_model(self) -> bool:
        return False

    @property
    def supports_draft_weight_updates(self) -> bool:
        return False

    @property
    def num_params(self) -> int:
        return 0

    def status(self) -> EngineStatus:
        return EngineStatus(
            paused=self._paused,
            pause_mode=self._pause_mode,
            sleeping_tags=list(self._sleeping),
            sleep_level=self._sleep_level,
            weights_loaded=True,
            in_flight=0,
            waiting=0,
            param_bytes=0,
            kv_cache_bytes=0,
        )

    async def generate(self, request: GenerateRequest) -> GenerateReply:
        return GenerateReply(worker_id="", tokens=[], finish_reason="length", weight_version=self.book.main.version,
                             weight_seq=self.book.main.seq)

    async def pause(self, mode: PauseMode) -> None:
        self._paused = True
        if mode == "abort" or self._pause_mode is None:
            self._pause_mode = mode

    async def resume(self) -> None:
        self._paused = False
        self._pause_mode = None

    async def sleep(self, level: int, tags: list[SleepTag]) -> None:
        self._sleeping = sorted(set(self._sleeping) | set(tags))
        self._sleep_level = max(self._sleep_level, level)

    async def wake_up(self, tags: list[SleepTag]) -> None:
        self._sleeping = [t for t in self._sleeping if t not in tags]
        if not self._sleeping:
            self._sleep_level = 0

    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]:
        return {}

    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        return {}

    async def load_weights(
        self, target: UpdateTarget, tensors: Mapping[str, torch.Tensor], written: set[str] | None = None,
        *, loaded: Callable[[], None] = lambda: None,
    ) -> None:
        loaded()


class TensorEngine(WeightlessEngine):
    """A WeightlessEngine that holds named tensors and takes updates into them: for pushing a
    model of any shape through the full path without a real model behind it."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__("tensors")
        self._params = dict(named)
        self._specs = {n: ParamSpec(dtype=t.dtype, shape=tuple(t.shape)) for n, t in named}

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self._params.values())

    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]:
        return self._specs

    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        return self._params

    async def load_weights(
        self, target: UpdateTarget, tensors: Mapping[str, torch.Tensor], written: set[str] | None = None,
        *, loaded: Callable[[], None] = lambda: None,
    ) -> None:
        for name, t in tensors.items():
            self._params[name].copy_(t)
        loaded()
