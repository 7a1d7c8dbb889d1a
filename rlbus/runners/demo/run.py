"""`rlbus demo`: embedded NATS + controller + workers as processes, the trainer in front."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from rlbus.models.tinylm import ModelConfig
from rlbus.runners.launcher import ProcessFleet, embedded_or

from .common import reward_summary, serve_progress
from .report import write_log, write_plot
from .trainer import DemoConfig, StepLog, Trainer


def worker_flags(model: ModelConfig, draft: ModelConfig | None, backend: str) -> list[str]:
    flags = [
        "--weight-transfer-backend",
        backend,
        "--vocab-size",
        str(model.vocab_size),
        "--d-model",
        str(model.d_model),
        "--n-layers",
        str(model.n_layers),
        "--n-heads",
        str(model.n_heads),
        "--max-seq-len",
        str(model.max_seq_len),
        "--seed",
        str(model.seed),
        "--dtype",
        model.dtype,
    ]
    if draft is not None:
        flags += ["--draft", "--draft-layers", str(draft.n_layers), "--draft-d-model", str(draft.d_model)]
    return flags


def _kib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB" if n >= 2**20 else f"{n / 1024:.0f}KiB"


def draft_config(model: ModelConfig) -> ModelConfig:
    """The draft `rlbus worker --draft` builds for this model (one layer, seed + 1000)."""
    return msgspec.structs.replace(model, n_layers=1, seed=model.seed + 1000)


def run_demo(
    *,
    workers: int,
    steps: int,
    out: Path,
    nats_url: str | None,
    draft: bool,
    backend: str,
    seed: int,
    max_staleness: int,
    async_rollouts: bool,
    spawn: bool = True,
    delta: bool = True,
    dtype: str = "bfloat16",
) -> list[StepLog]:
    from rich.console import Console

    console = Console(stderr=True)
    model = ModelConfig(seed=seed, dtype=dtype)  # type: ignore[arg-type]
    dcfg = draft_config(model) if draft else None
    cfg = DemoConfig(
        steps=steps,
        seed=seed,
        draft=draft,
        model=model,
        draft_model=dcfg,
        max_staleness=max_staleness,
        async_rollouts=async_rollouts,
        delta=delta,
    )
    out.mkdir(parents=True, exist_ok=True)
    url, server = embedded_or(nats_url)
    fleet = ProcessFleet(url, workers, worker_flags(model, dcfg, backend), log_level="WARNING")
    logs: list[StepLog] = []
    t0 = time.monotonic()
    try:
        if spawn:
            console.print(
                f"[bold]rlbus demo[/]: NATS {url}{' (embedded)' if server else ''}; starting controller + {workers} workers"
            )
            fleet.start()
        else:
            console.print(f"[bold]rlbus demo[/]: NATS {url}; waiting for a running controller and {workers} workers")

        def progress_line(g: StepLog) -> str:
            acc = f" acc {g.acceptance:.0%}" if g.acceptance is not None else ""
            changed = f" chg {g.changed_fraction:.0%}" if g.changed_fraction is not None else " dense"
            return (
                f"rew {g.reward:.2f}/{g.eval_reward:.2f} {g.version} "
                f"sync {g.sync_s * 1000:.0f}ms {_kib(g.bytes_pushed)}/{_kib(g.bytes_dense)}{changed}{acc} "
                f"drop {g.dropped}"
            )

        serve_progress(
            fleet,
            console,
            steps,
            t0,
            ready_timeout=None,
            rpc_timeout=60.0,
            logs=logs,
            stats=progress_line,
            describe=lambda info: (
                f"fleet ready: {[w.worker_id for w in info.workers]}, "
                f"backend {info.capabilities.weight_transfer_backend}, draft {info.capabilities.has_draft_model}"
            ),
            train=lambda rl, on_step: Trainer(rl, cfg, on_step=on_step).run(),
        )
    finally:
        if logs:
            meta = {
                "workers": workers,
                "steps": steps,
                "seed": seed,
                "backend": backend,
                "draft": draft,
                "max_staleness": max_staleness,
                "async_rollouts": async_rollouts,
                "wall_s": round(time.monotonic() - t0, 2),
                "delta": delta,
                "dtype": dtype,
            }
            write_log(out / "log.json", logs, meta)
            write_plot(out / "plot.png", logs)
        fleet.stop()
        if server is not None:
            server.stop()
    console.print(f"{reward_summary(logs, t0)}, dropped {sum(g.dropped for g in logs)} stale rollouts")
    if logs:
        sent, dense = sum(g.bytes_pushed for g in logs), sum(g.bytes_dense for g in logs)
        fractions = [g.changed_fraction for g in logs if g.changed_fraction is not None]
        console.print(
            f"weights sent: {_kib(sent)} of {_kib(dense)} dense ({sent / max(dense, 1):.1%}); "
            f"{sum(g.delta for g in logs)}/{len(logs)} pushes as deltas"
            + (f", median {sorted(fractions)[len(fractions) // 2]:.2%} of elements changed" if fractions else "")
            + (
                f"; {sum(g.fallback is not None for g in logs)} fell back to dense"
                if any(g.fallback for g in logs)
                else ""
            )
        )
    console.print(f"wrote {out / 'log.json'} and {out / 'plot.png'}")
    return logs
