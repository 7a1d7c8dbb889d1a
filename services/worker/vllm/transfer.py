"""rlbus's vLLM transfer engine: loads what this vLLM worker process received and verified.

The bytes arrive in this very process (extension.py: rlbus's transfer rank inside vLLM's
worker) and are checked there before commit; at commit the adapter drives vLLM's own
lifecycle — start_weight_update -> update_weights({"session_id": ...}) ->
finish_weight_update(version) — which runs this engine here. It hands the session's tensors
(checkpoint names) to the model's own `load_weights` from memory, through vLLM's layer-wise
reload, the only path that survives vLLM's repacked parameters and fused names (qkv_proj,
gate_up_proj). A fused layer needs all of its checkpoint tensors, so the tensors the session
did not change come from the committed segment (a view, no copy); once vLLM's load finished,
the session's tensors are written into that segment: they are the committed bits now.

Imported by vLLM only (through the plugin's lazy registration): it imports vllm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class StagedInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous here: rlbus's own transfer rank (extension.py) joins its group."""


@dataclass
class StagedUpdateInfo(WeightTransferUpdateInfo):
    session_id: str
    """The verified session whose tensors (held in this process, extension.STATE) to load."""
    fail_after: int | None = None
    """Tests only: raise after loading this many tensors (a failure inside vLLM's load)."""


class InjectedLoadFailure(RuntimeError):
    """The failure a test asked for, raised half-way through vLLM's load."""


class StagedTransferEngine(WeightTransferEngine[StagedInitInfo, StagedUpdateInfo]):
    init_info_cls = StagedInitInfo
    update_info_cls = StagedUpdateInfo
    supports_draft_weight_update = True
    _ties: list[Tie] = []

    def init_transfer_engine(self, init_info: StagedInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._ties = _tied_parameters(self.model)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from .extension import STATE

        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        _retie(self._ties)
        self._ties = []
        if STATE.session is not None:
            STATE.session.timed("load", t0)
        STATE.committed()

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # the base class syncs unconditionally, which fails on CPU
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: StagedUpdateInfo) -> None:
        from .extension import STATE

        s = STATE.session
        if s is None or s.id != update_info.session_id or not s.verified:
            raise RuntimeError(f"session {update_info.session_id} is not verified in this vLLM worker")
        committed = STATE.segments[s.target].tensors
        pairs = [(name, s.staged.get(name, t)) for name, t in committed.items()]
        if update_info.fail_after is not None:
            self.model.load_weights(pairs[: update_info.fail_after])  # type: ignore[operator]
            raise InjectedLoadFailure(f"injected failure after {update_info.fail_after} tensors")
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.load_weights(pairs)  # type: ignore[operator]
        s.timed("load", t0)

    def shutdown(self) -> None:
        pass


Tie = list[tuple[torch.nn.Module, str, int]]


def _tied_parameters(model: torch.nn.Module) -> list[Tie]:
    """Parameters shared by several modules (tied embeddings: lm_head.weight is
    embed_tokens.weight), each as (module, attribute, id of the shared parameter)."""
    seen: dict[int, Tie] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            seen.setdefault(id(p), []).append((module, name, id(p)))
    return [group for group in seen.values() if len(group) > 1]


def _retie(ties: list[Tie]) -> None:
    """Layer-wise reload rebuilds only the layers that received weights. A module that
    shares a parameter with one of them (a tied lm_head is never in a checkpoint) keeps the
    old tensor, and on CPU also its own prepacked copy for the GEMM: point it at the
    reloaded parameter again and let its quant method process it as after a load."""
    for group in ties:
        current = [(m, n, getattr(m, n)) for m, n, _ in group]
        fresh = [p for (_, _, p), (_, _, old) in zip(current, group) if id(p) != old]
        source = fresh[0] if fresh else current[0][2]
        for m, n, p in current:
            if p is source and fresh:
                continue  # reloaded and processed by vLLM itself
            setattr(m, n, source)
            method = getattr(m, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(m)
