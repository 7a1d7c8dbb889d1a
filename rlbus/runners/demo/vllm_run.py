"""`rlbus demo --engine vllm`: embedded NATS + controller + workers hosting vLLM, and the
transformers GRPO trainer (hf_trainer.py) in front, pushing to vLLM every step."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlbus.runners.launcher import ProcessFleet, embedded_or

from .common import reward_summary, serve_progress
from .hf_trainer import HfDemoConfig, HfStepLog, HfTrainer, write_models
from .report import write_log, write_plot

VLLM_START_TIMEOUT_S = 600.0
"""vLLM starts in tens of seconds per worker on a small CPU host (engine core, model, KV cache)."""


def vllm_worker_flags(policy: Path, draft: Path | None, backend: str, max_model_len: int) -> list[str]:
    flags = [
        "--engine",
        "vllm",
        "--model",
        str(policy),
        "--weight-transfer-backend",
        backend,
        "--vllm-arg",
        f"max_model_len={max_model_len}",
        "--vllm-arg",
        "max_num_seqs=64",
    ]
    if draft is not None:
        flags += ["--draft-model", str(draft), "--num-speculative-tokens", "3"]
    return flags


def run_vllm_demo(
    *,
    workers: int,
    steps: int,
    out: Path,
    nats_url: str | None,
    draft: bool,
    backend: str,
    seed: int,
    spawn: bool = True,
) -> list[HfStepLog]:
    from rich.console import Console

    console = Console(stderr=True)
    cfg = HfDemoConfig(steps=steps, seed=seed, draft=draft)
    out.mkdir(parents=True, exist_ok=True)
    policy_dir, draft_dir = write_models(out / "models", cfg)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU worker (inherited by the workers)
    url, server = embedded_or(nats_url)
    max_len = cfg.task.prompt_len + cfg.task.response_len + 16
    fleet = ProcessFleet(url, workers, vllm_worker_flags(policy_dir, draft_dir, backend, max_len), log_level="WARNING")
    logs: list[HfStepLog] = []
    t0 = time.monotonic()
    try:
        if spawn:
            console.print(
                f"[bold]rlbus demo (vLLM)[/]: NATS {url}{' (embedded)' if server else ''}; starting controller + "
                f"{workers} vLLM workers (tens of seconds each)"
            )
            fleet.start()

        def progress_line(g: HfStepLog) -> str:
            acc = f" acc {g.acceptance:.0%}" if g.acceptance is not None else ""
            return f"rew {g.reward:.2f}/{g.eval_reward:.2f} {g.version} sync {g.sync_s * 1000:.0f}ms {g.bytes_pushed / 2**20:.2f}MiB{acc}"

        serve_progress(
            fleet,
            console,
            steps,
            t0,
            ready_timeout=VLLM_START_TIMEOUT_S,
            rpc_timeout=120.0,
            logs=logs,
            stats=progress_line,
            describe=lambda info: (
                f"fleet ready in {time.monotonic() - t0:.0f} s: {[w.worker_id for w in info.workers]}, model "
                f"{info.capabilities.model_name}, backend {info.capabilities.weight_transfer_backend}, "
                f"draft {info.capabilities.has_draft_model}"
            ),
            train=lambda rl, on_step: HfTrainer(rl, cfg, policy_dir, draft_dir, on_step=on_step).run(),
        )
    finally:
        if logs:
            meta = {
                "engine": "vllm",
                "workers": workers,
                "steps": steps,
                "seed": seed,
                "backend": backend,
                "draft": draft,
                "wall_s": round(time.monotonic() - t0, 2),
            }
            write_log(out / "log.json", logs, meta)  # type: ignore[arg-type]
            write_plot(out / "plot.png", logs)  # type: ignore[arg-type]
        fleet.stop()
        if server is not None:
            server.stop()
    console.print(reward_summary(logs, t0))
    console.print(f"wrote {out / 'log.json'} and {out / 'plot.png'}")
    return logs
