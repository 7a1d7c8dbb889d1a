"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it
starts (front end, engine core, workers), so rlbus's transfer engine is known wherever
vLLM builds one.

Harmless when rlbus is not driving vLLM: it only adds the name `rlbus_staged` to vLLM's
registry of transfer engines, lazily (transfer.py is imported only when an engine is
configured with `weight_transfer_config={"backend": "rlbus_staged"}`).
"""

from __future__ import annotations

BACKEND = "rlbus_staged"
"""The name vLLM knows rlbus's transfer engine by (WeightTransferConfig.backend)."""


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:  # vLLM may load plugins more than once
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rlbus.services.worker.vllm.transfer", "StagedTransferEngine"
        )
