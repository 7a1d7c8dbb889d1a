"""Full-path weight push: rlbus start -> update -> finish (version committed) to R worker
processes, against the raw limit measured in the same run: one flat torch.distributed
broadcast of the same bytes to R receiver processes.

    python bench/push.py [--size-mb 1024] [--receivers 1,2,3] [--reps 3] [--mode in_place|staged]

The two are measured alternately, best of --reps each, so drift on a shared machine
hits both alike.

The rlbus time includes everything a trainer waits for: metadata through the controller
(every worker checks names/dtypes/shapes), packing and checksumming, the broadcast, every
worker verifying each bucket and writing the tensors, and the two-phase commit.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).parent))
from memory import config_for  # noqa: E402
from transfer import Fleet as RawFleet  # noqa: E402

from rlbus.launcher import Fleet  # noqa: E402
from rlbus.natsserver import NatsServer  # noqa: E402
from rlbus.services.worker.model import TinyLM  # noqa: E402

MiB = 1 << 20


def worker_flags(cfg, mode: str) -> list[str]:  # noqa: ANN001
    return [
        "--weight-transfer-backend", "gloo", "--update-mode", mode, "--max-concurrency", "1",
        "--vocab-size", str(cfg.vocab_size), "--d-model", str(cfg.d_model), "--n-layers", str(cfg.n_layers),
        "--n-heads", str(cfg.n_heads), "--max-seq-len", str(cfg.max_seq_len),
    ]


async def measure(url: str, r: int, cfg, named, flat, reps: int, mode: str, bucket: int) -> tuple[float, float]:  # noqa: ANN001
    """Best seconds of the raw flat broadcast and of the rlbus push to R receivers, measured
    alternately (raw, rlbus, raw, rlbus, ...) so that a slow spell of a shared machine hits
    both sides alike; each rlbus push commits a new version."""
    fleet = Fleet(url, r, worker_flags(cfg, mode), log_level="WARNING")
    raw_fleet = RawFleet(r)
    fleet.start()
    try:
        rl = await fleet.wait_ready()
        rl.timeout = 300
        await rl.init_weight_transfer(timeout_s=120)
        raw_best = rl_best = float("inf")
        for rep in range(reps + 1):
            raw = await anyio.to_thread.run_sync(
                lambda: raw_fleet.run(r, "gloo", "raw", 1, lambda tx: tx.send(flat).wait(), sizes=[flat.numel()]))
            t0 = time.monotonic()
            await rl.start_weight_update()
            await rl.update_weights(named, bucket_bytes=bucket)
            await rl.finish_weight_update(f"bench-{rep}")
            if rep:  # the first push warms buffers and pools
                raw_best, rl_best = min(raw_best, raw), min(rl_best, time.monotonic() - t0)
        await rl.close()
        return raw_best, rl_best
    finally:
        fleet.stop()
        raw_fleet.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="model size (the issue: ~1 GiB)")
    ap.add_argument("--receivers", default="1,2,3")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", default="in_place", choices=["in_place", "staged"])
    ap.add_argument("--bucket-mb", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = config_for(a.size_mb)
    model = TinyLM(cfg)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    flat = torch.ones(nbytes, dtype=torch.uint8)
    print(f"machine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}, torch {torch.__version__}")
    print(f"model: {len(named)} tensors, {nbytes / MiB:.0f} MiB float32; bucket {a.bucket_mb} MiB; worker mode {a.mode}")
    rows = []
    with NatsServer() as server:
        for r in [int(x) for x in a.receivers.split(",")]:
            raw, full = anyio.run(measure, server.url, r, cfg, named, flat, a.reps, a.mode, a.bucket_mb * MiB)
            rows.append((r, raw, full))
            print(f"  R={r} done", flush=True)
    print(f"\n{'R':>3} {'raw GB/s':>9} {'rlbus GB/s':>11} {'rlbus/raw':>10}   goal >= 0.9")
    for r, raw, full in rows:
        print(f"{r:3d} {nbytes / raw / 1e9:9.2f} {nbytes / full / 1e9:11.2f} {raw / full:10.2f}")


if __name__ == "__main__":
    main()
