"""Worker memory benchmark: peak RSS of a real worker process during a weight update.

    python bench/memory.py [--size-mb 256] [--bucket-mb 32] [--pushes 2] [--modes staged,in_place]
    python bench/memory.py --engine vllm [--size-mb 128] [--pushes 2] [--modes staged,in_place]

Per update mode it starts an embedded nats-server, a controller process and one worker
process (`python -m rlbus worker --weight-transfer-backend gloo --update-mode MODE`, a
reference model of about --size-mb of float32, KV cache kept tiny), joins the gloo group,
then pushes a different model (same config, seed=1) --pushes times with
RLClient.push_weights(bucket_bytes=--bucket-mb MiB). A thread samples the worker's
/proc/<pid>/status VmRSS every ~5 ms during each push; VmHWM (the kernel's high-water
mark since process start) is read at the end as a cross-check.

  baseline  VmRSS when idle: model loaded, registered, transfer group joined
  peak      max sampled VmRSS during the pushes
  extra     peak - baseline, against the targets
            in_place: extra <= 2 buckets           (peak <= model + 2 buckets)
            staged:   extra <= model + 2 buckets   (peak <= 2 x model + 2 buckets)

The trainer (this process) is sampled the same way: its extra is the two scratch buffers
update_weights packs the shared buckets into (a bucket that is one tensor is sent from it).

--delta-changed F (default 0.01; 0 skips it): then the same worker takes --pushes delta pushes
(push_weights(delta=True)) of the model with a fraction F of its elements changed each time,
after one tracked dense push that gives the trainer its snapshot. Reported: the worker's extra
during the delta pushes (staged: a copy of every touched tensor, the delta's base; in_place:
the received delta buckets and their decoded positions), and the trainer's: the snapshot (the
committed bits of every tensor sent, one model in its transfer dtype) plus what a push holds
until its commit (the encoded deltas), measured from the process's RSS.

--engine vllm: per mode one `rlbus worker --engine vllm --update-mode MODE` (a Qwen2 model
folder of --size-mb) and every process it runs, each sampled on its own: the rlbus worker (the
NATS side: it carries no bytes), vLLM's engine core, vLLM's worker (where the bytes land: its
extra is the staged update, then vLLM's load; in place the bytes land in the segment). The committed base is the /dev/shm segment vLLM starts from (shared
memory, counted once, beside the processes: pages a process touched of it also show in its RSS).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import threading
import time

import anyio
import torch

from rlbus.models.tinylm import ModelConfig, TinyLM
from rlbus.runners.natsserver import NatsServer
from rlbus.sdk.client import RLClient

MiB = 1 << 20
D_MODEL, N_HEADS, VOCAB, SEQ = 1024, 8, 64, 16


def config_for(size_mb: int) -> ModelConfig:
    """d_model 1024 and as many layers as bring float32 params closest to size_mb."""
    d = D_MODEL
    per_layer = 12 * d * d + 13 * d  # qkv, proj, fc1, fc2 (+ biases), two layer norms
    fixed = 2 * VOCAB * d + 2 * d  # embedding, lm_head, final norm
    layers = max(1, round((size_mb * MiB / 4 - fixed) / per_layer))
    return ModelConfig(vocab_size=VOCAB, d_model=d, n_layers=layers, n_heads=N_HEADS, max_seq_len=SEQ)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (and RssAnon / RssShmem: private and shared-memory pages) of pid in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssShmem:")):
                key, value, _unit = line.split()
                out[key[:-1]] = int(value) * 1024
    return out


def qwen2_folder(folder, size_mb: int, init_std: float = 0.02):
    """A Qwen2 model folder of about size_mb float32 (hidden 1024, 32 heads of 32, one KV head,
    vocab 8192, tied embeddings): as many layers as bring it closest."""
    from rlbus.services.worker.vllm.checkpoint import write_toy_model

    hidden, vocab = 1024, 8192
    per_layer = 8 * hidden * hidden + 2 * 32 * hidden + 4 * hidden  # q, o, mlp (6h^2), k, v, norms and biases
    layers = max(1, round((size_mb * MiB / 4 - vocab * hidden) / per_layer))
    return write_toy_model(folder, hidden=hidden, layers=layers, vocab=vocab, max_positions=256, init_std=init_std)


class TreeSampler:
    """Peak RssAnon (private pages: the shared segment is counted once, apart) of each process
    of a tree (a worker and its children), sampled every ~5 ms."""

    def __init__(self, pids: dict[str, int], interval: float = 0.005) -> None:
        self.pids, self.interval = pids, interval
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for name, pid in self.pids.items():
            self.peak[name] = max(self.peak[name], proc_status(pid)["RssAnon"])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def vllm_processes(pid: int) -> dict[str, int]:
    """The rlbus worker `pid` and vLLM's processes under it, by role."""
    import psutil

    out = {"rlbus worker": pid}
    for child in psutil.Process(pid).children(recursive=True):
        name = child.name()
        if name.startswith("VLLM::"):
            out["vLLM " + name.removeprefix("VLLM::")] = child.pid
    return out


def segment_bytes(pid: int) -> int:
    """Bytes of the committed segments the vLLM worker `pid` keeps in /dev/shm."""
    from pathlib import Path

    return sum(f.stat().st_size for d in Path("/dev/shm").glob(f"rlbus-vllm-{pid}-*") for f in d.rglob("*"))


async def only_worker(rl: RLClient, worker_id: str, timeout: float) -> None:
    """Wait until the controller is up and `worker_id` is the fleet's one worker."""
    with anyio.fail_after(timeout):
        while True:
            try:
                if [w.worker_id for w in (await rl.server_info()).workers] == [worker_id]:
                    return
            except Exception:  # controller not up yet
                pass
            await anyio.sleep(0.2)  # poll period: the bench waits on a process it started


async def measure_vllm(a: argparse.Namespace) -> None:
    for mode in a.modes.split(","):
        await measure_vllm_mode(a, mode)


async def measure_vllm_mode(a: argparse.Namespace, mode: str) -> None:
    import shutil
    import tempfile
    from pathlib import Path

    from rlbus.services.worker.vllm.checkpoint import read_tensors

    tmp = Path(tempfile.mkdtemp(prefix="rlbus-memory-vllm-"))
    try:
        folder = qwen2_folder(tmp / "qwen2", a.size_mb)
        new = [(n, t + 0.01) for n, t in read_tensors(folder).items()]
        model_bytes = sum(t.numel() * t.element_size() for _, t in new)
        bucket = a.bucket_mb * MiB
        print(f"machine: {os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__}")
        print(
            f"vLLM worker ({mode}): Qwen2 {len(new)} tensors, {model_bytes / MiB:.0f} MiB float32; "
            f"bucket {a.bucket_mb} MiB"
        )
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        with NatsServer() as server, open(os.devnull, "w") as log:  # noqa: ASYNC230 - /dev/null does not block
            ctrl = _spawn(["controller", "--nats-url", server.url], log)
            worker = _spawn(
                [
                    "worker",
                    "--nats-url",
                    server.url,
                    "--id",
                    "w0",
                    "--engine",
                    "vllm",
                    "--model",
                    str(folder),
                    "--weight-transfer-backend",
                    "gloo",
                    "--update-mode",
                    mode,
                    "--vllm-arg",
                    "max_model_len=256",
                    "--vllm-arg",
                    "max_num_seqs=4",
                    "--heartbeat",
                    "1.0",
                ],
                log,
            )
            try:
                rl = await RLClient.connect(server.url, timeout=300)
                try:
                    await only_worker(rl, "w0", timeout=600)
                    await rl.init_weight_transfer(timeout_s=120)
                    await anyio.sleep(1.0)
                    procs = vllm_processes(worker.pid)
                    baseline = {k: proc_status(p)["RssAnon"] for k, p in procs.items()}
                    segment = segment_bytes(worker.pid)
                    with TreeSampler(procs) as dense:
                        for k in range(a.pushes):
                            await rl.push_weights(new, f"v{k + 1}", bucket_bytes=bucket)
                    current = [(n, t.clone()) for n, t in new]
                    await rl.push_weights(current, "d0", bucket_bytes=bucket, delta=True)
                    g = torch.Generator().manual_seed(0)
                    with TreeSampler(procs) as deltas:
                        for k in range(a.pushes):
                            for _, t in current:
                                flat = t.view(-1)
                                idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * 0.01)),), generator=g)
                                flat[idx] += 1.0
                            await rl.push_weights(current, f"d{k + 1}", bucket_bytes=bucket, delta=True)
                            assert rl.last_push is not None and rl.last_push.delta, rl.last_push
                    await anyio.sleep(1.0)  # the freed staged pages go back to the OS in a thread of the worker's
                    after = {k: proc_status(p)["RssAnon"] for k, p in procs.items()}
                    shared = {k: proc_status(p)["RssShmem"] for k, p in procs.items()}
                finally:
                    await rl.close()
            finally:
                _stop(worker)
                _stop(ctrl)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\n{'process':18s} {'baseline':>9s} {'dense peak':>11s} {'extra':>9s} {'x model':>8s} "
        f"{'delta peak':>11s} {'extra':>9s} {'x model':>8s} {'after':>9s} {'+ shared':>9s}   (private RSS)"
    )
    for k in procs:
        de, dd = dense.peak[k] - baseline[k], deltas.peak[k] - baseline[k]
        print(
            f"{k:18s} {baseline[k] / MiB:7.0f}Mi {dense.peak[k] / MiB:9.0f}Mi {de / MiB:7.0f}Mi {de / model_bytes:8.2f} "
            f"{deltas.peak[k] / MiB:9.0f}Mi {dd / MiB:7.0f}Mi {dd / model_bytes:8.2f} {after[k] / MiB:7.0f}Mi "
            f"{shared[k] / MiB:7.0f}Mi"
        )
    print(
        f"committed base: the /dev/shm segment, {segment / MiB:.0f} MiB = {segment / model_bytes:.2f} x model, once "
        "(vLLM starts and restarts from it; its worker reads a delta's base there and writes each commit there; "
        "pages a process touched of it are in its RSS too). Targets: the vLLM worker's extra <= model + 2 buckets "
        "(staged), <= 2 buckets + vLLM's reload transients (in_place)."
    )


class Sampler:
    """Samples VmRSS of pid every `interval` s in a thread while active."""

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status(self.pid)["VmRSS"])
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status(self.pid)["VmRSS"])


def _spawn(args: list[str], log) -> subprocess.Popen:
    env = dict(os.environ, RLBUS_LOG_LEVEL="WARNING")
    return subprocess.Popen([sys.executable, "-m", "rlbus", *args], stdout=log, stderr=log, env=env)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def measure(
    mode: str, cfg: ModelConfig, new: list[tuple[str, torch.Tensor]], bucket: int, pushes: int, changed: float = 0.0
) -> dict:
    with NatsServer() as server, open(os.devnull, "w") as log:  # noqa: ASYNC230 - /dev/null does not block
        ctrl = _spawn(["controller", "--nats-url", server.url], log)
        worker = _spawn(
            [
                "worker",
                "--nats-url",
                server.url,
                "--id",
                "w0",
                "--weight-transfer-backend",
                "gloo",
                "--update-mode",
                mode,
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
                "--max-concurrency",
                "1",
                "--no-draft",
                "--heartbeat",
                "1.0",
            ],
            log,
        )
        try:
            rl = await RLClient.connect(server.url, timeout=120)
            try:
                await only_worker(rl, "w0", timeout=120)
                await rl.init_weight_transfer()
                await anyio.sleep(0.5)
                baseline = proc_status(worker.pid)["VmRSS"]
                trainer_baseline = proc_status(os.getpid())["VmRSS"]
                peaks, secs, trainer_peak = [], [], 0
                for k in range(pushes):
                    t0 = time.monotonic()
                    with Sampler(worker.pid) as s, Sampler(os.getpid()) as me:
                        await rl.push_weights(new, f"v{k + 1}", bucket_bytes=bucket)
                    secs.append(time.monotonic() - t0)
                    peaks.append(s.peak)
                    trainer_peak = max(trainer_peak, me.peak)
                after = proc_status(worker.pid)
                version = await rl.get_weight_version()
                assert version == f"v{pushes}", version
                delta = await _delta_pushes(rl, worker.pid, new, bucket, pushes, changed) if changed else None
            finally:
                await rl.close()
        finally:
            _stop(worker)
            _stop(ctrl)
    return {
        "baseline": baseline,
        "peaks": peaks,
        "hwm": after["VmHWM"],
        "rss_after": after["VmRSS"],
        "secs": secs,
        "samples": s.samples,
        "trainer_extra": trainer_peak - trainer_baseline,
        "delta": delta,
    }


async def _delta_pushes(
    rl: RLClient, pid: int, new: list[tuple[str, torch.Tensor]], bucket: int, pushes: int, changed: float
) -> dict:
    """One tracked dense push (the trainer's snapshot), then `pushes` deltas with a fraction
    `changed` of the elements different each time; peaks of the worker and the trainer."""
    current = [(n, t.clone()) for n, t in new]
    trainer_before = proc_status(os.getpid())["VmRSS"]
    await rl.push_weights(current, "d0", bucket_bytes=bucket, delta=True)
    await anyio.sleep(0.5)
    baseline = proc_status(pid)["VmRSS"]
    trainer_baseline = proc_status(os.getpid())["VmRSS"]
    g = torch.Generator().manual_seed(0)
    peaks, trainer_peak, sent = [], 0, []
    for k in range(pushes):
        for _, t in current:
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * changed)),), generator=g)
            flat[idx] += 1.0
        with Sampler(pid) as s, Sampler(os.getpid()) as me:
            await rl.push_weights(current, f"d{k + 1}", bucket_bytes=bucket, delta=True)
        st = rl.last_push
        assert st is not None and st.delta, st
        sent.append(st.bytes_sent)
        peaks.append(s.peak)
        trainer_peak = max(trainer_peak, me.peak)
    return {
        "baseline": baseline,
        "peak": max(peaks),
        "sent": max(sent),
        "snapshot": rl.push.snapshot_bytes,
        "trainer_held": trainer_baseline - trainer_before,
        "trainer_extra": trainer_peak - trainer_before,
    }


async def amain(a: argparse.Namespace) -> None:
    cfg = config_for(a.size_mb)
    new_cfg = ModelConfig(**{**{f: getattr(cfg, f) for f in cfg.__struct_fields__}, "seed": 1})
    model = TinyLM(new_cfg)
    new = [(n, p.detach()) for n, p in model.named_parameters()]
    model_bytes = sum(t.numel() * t.element_size() for _, t in new)
    bucket = a.bucket_mb * MiB
    kv = 2 * cfg.n_layers * cfg.max_seq_len * cfg.d_model * 4
    print(f"machine: {os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__}")
    print(
        f"model: d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size} -> {model_bytes / MiB:.1f} MiB float32 "
        f"({len(new)} tensors); KV cache {kv / MiB:.2f} MiB; bucket {a.bucket_mb} MiB; {a.pushes} push(es) per mode"
    )
    rows = []
    for mode in a.modes.split(","):
        t0 = time.monotonic()
        r = await measure(mode, cfg, new, bucket, a.pushes, a.delta_changed)
        rows.append((mode, r))
        pushes = ", ".join(f"{p / MiB:.0f} MiB in {s:.1f}s" for p, s in zip(r["peaks"], r["secs"]))
        print(
            f"  {mode:8s} done in {time.monotonic() - t0:5.1f}s  peaks per push: {pushes}; "
            f"RSS after {r['rss_after'] / MiB:.0f} MiB; last push {r['samples']} samples",
            flush=True,
        )
    print()
    print(
        f"{'mode':8s} {'baseline':>9s} {'peak':>9s} {'VmHWM':>9s} {'extra':>9s} {'target':>9s} {'extra/target':>13s}   "
        f"{'extra in models':>15s} {'extra in buckets':>16s}"
    )
    for mode, r in rows:
        peak = max(max(r["peaks"]), 0)
        extra = peak - r["baseline"]
        target = 2 * bucket + (model_bytes if mode == "staged" else 0)
        ok = "met" if extra <= target else "MISSED"
        print(
            f"{mode:8s} {r['baseline'] / MiB:7.0f}Mi {peak / MiB:7.0f}Mi {r['hwm'] / MiB:7.0f}Mi {extra / MiB:7.0f}Mi "
            f"{target / MiB:7.0f}Mi {extra / target:12.2f}x   {extra / model_bytes:15.2f} {extra / bucket:16.2f}   {ok}"
        )
    for mode, r in rows:
        print(
            f"trainer during the {mode} pushes: extra {r['trainer_extra'] / MiB:.0f} MiB = "
            f"{r['trainer_extra'] / bucket:.2f} buckets = {r['trainer_extra'] / model_bytes:.2f} x model (two scratch buffers)"
        )
    for mode, r in rows:
        d = r["delta"]
        if d is None:
            continue
        extra = d["peak"] - d["baseline"]
        print(
            f"{mode}+delta ({a.delta_changed:.0%} changed, {d['sent'] / MiB:.1f} MiB sent): worker extra {extra / MiB:.0f} MiB = "
            f"{extra / model_bytes:.2f} x model = {extra / max(d['sent'], 1):.2f} x the delta sent; trainer: snapshot "
            f"{d['snapshot'] / MiB:.0f} MiB ({d['snapshot'] / model_bytes:.2f} x model), RSS +{d['trainer_held'] / MiB:.0f} MiB "
            f"held between pushes, +{d['trainer_extra'] / MiB:.0f} MiB at the peak of a delta push"
        )
    print(
        "\ntargets: in_place extra <= 2 buckets (peak <= model + 2 buckets); "
        "staged extra <= model + 2 buckets (peak <= 2 x model + 2 buckets). MiB = 2^20 bytes."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="reference", choices=["reference", "vllm"])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--pushes", type=int, default=2)
    ap.add_argument("--modes", default="staged,in_place")
    ap.add_argument(
        "--delta-changed",
        type=float,
        default=0.01,
        help="fraction of elements a delta push changes (0: no delta pushes)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    anyio.run(measure_vllm if a.engine == "vllm" else amain, a)


if __name__ == "__main__":
    main()
