"""The GPU path: a transformers trainer on cuda:0 pushes over NCCL to a worker process that
hosts vLLM on cuda:1; vLLM's greedy output then equals transformers' on the pushed weights.
Needs the `vllm` extra (CUDA build) and two GPUs (two NCCL ranks cannot share one device);
skipped elsewhere."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra: pip install -e '.[vllm]' (docs/vllm.md)")
transformers = pytest.importorskip("transformers")

import anyio  # noqa: E402
import torch  # noqa: E402
from rlbus.schemas import Subjects  # noqa: E402
from rlbus.services.controller.service import ControllerOptions  # noqa: E402
from rlbus.services.worker.vllm.checkpoint import write_toy_model  # noqa: E402

from rlbus.runners.children import spawn  # noqa: E402
from rlbus.runners.local import LocalFleet  # noqa: E402
from rlbus.sdk.client import RLClient  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="nccl needs two CUDA devices (trainer on one, the vLLM worker on the other)",
    ),
]

PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [100, 200]]


async def test_a_push_over_nccl_lands_in_vllm_and_greedy_output_matches_transformers(nats_server, prefix, tmp_path):
    base = write_toy_model(tmp_path / "base", seed=0)
    trained = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(write_toy_model(tmp_path / "trained", seed=1)), dtype=torch.float32
        )
        .to("cuda:0")
        .eval()
    )
    subjects = Subjects(prefix=prefix)
    local = LocalFleet(nats_server.url)
    controller = await local.start_controller(ControllerOptions(subjects=subjects, command_timeout_s=120.0))
    worker = spawn(
        [
            sys.executable,
            "-m",
            "rlbus",
            "worker",
            "--nats-url",
            nats_server.url,
            "--prefix",
            prefix,
            "--id",
            "g0",
            "--engine",
            "vllm",
            "--model",
            str(base),
            "--weight-transfer-backend",
            "nccl",
            "--vllm-arg",
            "gpu_memory_utilization=0.3",
            "--vllm-arg",
            "max_model_len=256",
        ],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="1"),
    )
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=300.0)
    try:
        torch.cuda.set_device(0)
        with anyio.fail_after(400):
            await controller.wait_for(lambda reg: "g0" in reg)
        await rl.push_weights([(n, p.detach()) for n, p in trained.named_parameters()], version="gpu-1")
        for p in PROMPTS:
            reply = await rl.generate(p, 16)
            with torch.no_grad():
                expected = trained.generate(
                    torch.tensor([p], device="cuda:0"), max_new_tokens=16, min_new_tokens=16, do_sample=False
                )[0, len(p) :].tolist()
            assert reply.tokens == expected and reply.weight_version == "gpu-1"
    finally:
        await rl.close()
        worker.terminate()
        worker.wait(60)
        await local.close()
