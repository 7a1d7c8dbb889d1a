"""`rlbus demo`: embedded NATS + controller + workers as processes, the trainer in front."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import msgspec

from rlbus.runners.launcher import Fleet, embedded_or
from rlbus.models.tinylm import ModelConfig

from .report import write_log, write_plot
from .trainer import DemoConfig, StepLog, Trainer


def worker_flags(model: ModelConfig, draft: ModelConfig | None, backend: str) -> list[str]:
    flags = [
        "--weight-transfer-backend", backend,
        "--vocab-size", str(model.vocab_size), "--d-model", str(model.d_model),
        "--n-layers", str(model.n_layers), "--n-heads", str(model.n_heads),
        "--max-seq-len", str(model.max_seq_len), "--seed", str(model.seed), "--dtype", model.dtype,
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
    *, workers: int, steps: int, out: Path, nats_url: str | None, draft: bool, backend: str, seed: int,
    max_staleness: int, async_rollouts: bool, spawn: bool = True, delta: bool = True, dtype: str = "bfloat16",
) -> list[StepLog]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    model = ModelConfig(seed=seed, dtype=dtype)  # type: ignore[arg-type]
    dcfg = draft_config(model) if draft else None
    cfg = DemoConfig(
        steps=steps, seed=seed, draft=draft, model=model, draft_model=dcfg,
        max_staleness=max_staleness, async_rollouts=async_rollouts, delta=delta,
    )
    out.mkdir(parents=True, exist_ok=True)
    url, server = embedded_or(nats_url)
    fleet = Fleet(url, workers, worker_flags(model, dcfg, backend), log_level="WARNING")
    logs: list[StepLog] = []
    t0 = time.monotonic()
    try:
        if spawn:
            console.print(f"[bold]rlbus demo[/]: NATS {url}{' (embedded)' if server else ''}; starting controller + {workers} workers")
            fleet.start()
        else:
            console.print(f"[bold]rlbus demo[/]: NATS {url}; waiting for a running controller and {workers} workers")

        async def main() -> None:
            rl = await fleet.wait_ready()
            rl.timeout = 60.0
            try:
                info = await rl.server_info()
                console.print(
                    f"fleet ready: {[w.worker_id for w in info.workers]}, backend {info.capabilities.weight_transfer_backend}, "
                    f"draft {info.capabilities.has_draft_model}"
                )
                with Progress(
                    TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=12), TextColumn("{task.fields[stats]}"),
                    TimeElapsedColumn(), console=console,
                ) as bar:
                    task = bar.add_task("train", total=steps, stats="")

                    def on_step(g: StepLog) -> None:
                        acc = f" acc {g.acceptance:.0%}" if g.acceptance is not None else ""
                        changed = f" chg {g.changed_fraction:.0%}" if g.changed_fraction is not None else " dense"
                        bar.update(
                            task, advance=1,
                            stats=f"rew {g.reward:.2f}/{g.eval_reward:.2f} {g.version} "
                                  f"sync {g.sync_s * 1000:.0f}ms {_kib(g.bytes_pushed)}/{_kib(g.bytes_dense)}{changed}{acc} "
                                  f"drop {g.dropped}",
                        )

                    trainer = Trainer(rl, cfg, on_step=on_step)
                    logs.extend(await trainer.run())
                final = await rl.server_info()
                console.print(f"committed version {final.weight_version}, draft {final.draft_version}")
            finally:
                with anyio.CancelScope(shield=True):
                    await rl.close()

        anyio.run(main)
    finally:
        if logs:
            meta = {
                "workers": workers, "steps": steps, "seed": seed, "backend": backend, "draft": draft,
                "max_staleness": max_staleness, "async_rollouts": async_rollouts, "wall_s": round(time.monotonic() - t0, 2),
                "delta": delta, "dtype": dtype,
            }
            write_log(out / "log.json", logs, meta)
            write_plot(out / "plot.png", logs)
        fleet.stop()
        if server is not None:
            server.stop()
    k = max(1, len(logs) // 5)
    first = sum(g.reward for g in logs[:k]) / k
    last = sum(g.reward for g in logs[-k:]) / k
    syncs = sorted(g.sync_s for g in logs)
    console.print(
        f"[bold]done[/] in {time.monotonic() - t0:.0f} s: reward {first:.2f} -> {last:.2f} (first/last {k} steps), "
        f"median sync {syncs[len(syncs) // 2] * 1000:.0f} ms, dropped {sum(g.dropped for g in logs)} stale rollouts"
    )
    if logs:
        sent, dense = sum(g.bytes_pushed for g in logs), sum(g.bytes_dense for g in logs)
        fractions = [g.changed_fraction for g in logs if g.changed_fraction is not None]
        console.print(
            f"weights sent: {_kib(sent)} of {_kib(dense)} dense ({sent / max(dense, 1):.1%}); "
            f"{sum(g.delta for g in logs)}/{len(logs)} pushes as deltas"
            + (f", median {sorted(fractions)[len(fractions) // 2]:.2%} of elements changed" if fractions else "")
            + (f"; {sum(g.fallback is not None for g in logs)} fell back to dense" if any(g.fallback for g in logs) else "")
        )
    console.print(f"wrote {out / 'log.json'} and {out / 'plot.png'}")
    return logs
