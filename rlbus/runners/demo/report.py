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
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
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
    ax = axes[3]
    ax.plot(steps, [g.bytes_dense / 2**20 for g in logs], color="tab:gray", label="dense")
    ax.plot(steps, [g.bytes_pushed / 2**20 for g in logs], color="tab:blue", label="sent (delta)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("MiB per step")
    ax.set_title("bytes per step and elements changed")
    changed = [(g.step, 100 * g.changed_fraction) for g in logs if g.changed_fraction is not None]
    if changed:
        ax2 = ax.twinx()
        ax2.plot(
            [a for a, _ in changed], [b for _, b in changed], color="tab:orange", ls="--", label="% elements changed"
        )
        ax2.set_ylabel("% of elements changed")
        ax2.set_ylim(0, max(b for _, b in changed) * 1.2 + 1e-9)
        ax2.legend(loc="upper right", fontsize=8)
    ax.legend(loc="center right", fontsize=8)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
