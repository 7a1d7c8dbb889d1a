"""What the demo leaves behind: a JSON log of every step and a PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgspec

from .trainer import StepLog


def write_log(path: Path, logs: Sequence[StepLog], meta: dict[str, object]) -> None:
    path.write_text(json.dumps({"meta": meta, "steps": msgspec.to_builtins(list(logs))}, indent=1))


def write_plot(path: Path, logs: Sequence[StepLog]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [g.step for g in logs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    ax.plot(steps, [g.reward for g in logs], label="rollout reward (sampled)")
    ax.plot(steps, [g.eval_reward for g in logs], label="eval reward (greedy)")
    ax.set_ylim(0, 1.05)
    ax.set_title("reward")
    ax.legend(loc="lower right", fontsize=8)
    ax = axes[1]
    acc = [(g.step, g.acceptance) for g in logs if g.acceptance is not None]
    if acc:
        ax.plot([a for a, _ in acc], [b for _, b in acc], color="tab:green")
        for g in logs:
            if g.draft_version == f"draft-{g.step}":
                ax.axvline(g.step, color="tab:gray", alpha=0.25, lw=1)
    ax.set_ylim(0, 1.05)
    ax.set_title("draft acceptance (grey: draft pushed)")
    ax = axes[2]
    ax.plot(steps, [g.sync_s * 1000 for g in logs], color="tab:red")
    ax.set_title("weight sync per step (ms)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
