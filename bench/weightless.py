"""WeightlessEngine: an Engine with no model, for control-plane benchmarks.

The Engine base keeps the state a real engine reports (paused, pause mode, sleeping tags,
levels); the model calls here cost nothing, so a benchmark built on it measures rlbus, not torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from rlbus.schemas import GenerateReply, GenerateRequest, UpdateTarget
from rlbus.services.worker.engine import Engine, ParamSpec


class WeightlessEngine(Engine):
    """Holds no parameters; every model call returns at once."""

    def __init__(self, model_name: str = "weightless", *, sleep_mode_enabled: bool = True) -> None:
        super().__init__(model_name, sleep_mode_enabled=sleep_mode_enabled)

    @property
    def num_params(self) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> GenerateReply:
        label = self.book.main
        return GenerateReply(
            worker_id="", tokens=[], finish_reason="length", weight_version=label.version, weight_seq=label.seq
        )

    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]:
        return {}

    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        return {}

    async def load_weights(
        self,
        target: UpdateTarget,
        tensors: Mapping[str, torch.Tensor],
        written: set[str] | None = None,
        *,
        loaded: Callable[[], None] = lambda: None,
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
        self,
        target: UpdateTarget,
        tensors: Mapping[str, torch.Tensor],
        written: set[str] | None = None,
        *,
        loaded: Callable[[], None] = lambda: None,
    ) -> None:
        for name, t in tensors.items():
            self._params[name].copy_(t)
        loaded()
