"""The data plane on the tensors' device, checked: one line per check, exit status 1 if one failed.

    python bench/device_paths.py --device cuda|cpu [--size-mb N] [--reps 3] [--changed 0.005]
                                 [--base device|pinned] [--strict]

A trainer (this process, rank 0) and one receiver process (rank 1) in a real group: NCCL between
two GPUs for ``--device cuda`` (the receiver on the last visible GPU; NCCL refuses two ranks on
one GPU), gloo on the host for ``--device cpu`` with the device checksum and the device delta
forced (RLBUS_CHECKSUM=device, RLBUS_DELTA=device), so the same code runs. A bf16 model of
``--size-mb`` (~40 tensors, a few small ones sharing buckets) lives on the device on both sides.
Measured in turn, best of ``--reps``:

  raw     one flat broadcast of the model's bytes (the wire's limit)
  dense   rlbus's stream: packed on the device (or sent from the tensors' memory), hashed there
          with the device checksum, received into the receiver's live tensors on its device,
          hashed there; the receiver's checksums must equal the trainer's
  delta   the same model with ``--changed`` of its elements changed (>= 99% unchanged): compared
          and encoded on the trainer's device against its committed copy (``--base``: on the
          device, or in pinned host memory), sent, written onto the receiver's tensors on its
          device, every result hashed there and checked against the trainer's

Checks: the bytes stayed on the device and arrived bit-identical (checksums on both ends, the
results of the delta); dense >= 0.9x raw; delta >= 10x dense. On ``--device cpu`` the speed
checks are reported, not enforced (the "wire" is loopback TCP on the same cores that compare
and hash; see docs/performance.md) unless ``--strict``; it runs in well under 30 s.

Before those, on the (first) device alone: the device checksum equals the host's digest of the
same bytes, a delta compared, encoded and applied there (base on the device and in pinned host
memory) is bit-identical, and both kernels' throughput against a device copy of the same bytes
(reported). With a single GPU the NCCL checks are reported as SKIP (NCCL refuses two ranks on
one GPU) and the exit status is that of the single-device checks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import uuid

import torch

MiB = 1 << 20


def model(size: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """~40 bf16 tensors of ``size`` bytes in all: a few big matrices and small ones that share buckets."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    elems = size // 2
    big = [elems // 6, elems // 6, elems // 8, elems // 8, elems // 12]
    rest = elems - sum(big)
    small = [max(1, rest // 36)] * 35
    small.append(rest - sum(small))
    out = {}
    for i, n in enumerate(big + small):
        out[f"t{i:02d}"] = torch.randn(n, generator=g).to(torch.bfloat16).to(device)
    return out


def changed(base: dict[str, torch.Tensor], fraction: float, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, t in base.items():
        new = t.clone()
        k = max(1, int(t.numel() * fraction))
        where = torch.randint(0, t.numel(), (k,), generator=g).to(t.device)
        new[where] = (new[where].float() * 1.01 + 1e-3).to(torch.bfloat16)
        out[name] = new
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --- the receiver ---------------------------------------------------------------------------


def receiver(conn, init, device: str, size: int) -> None:
    from rlbus.transfer import delta as D
    from rlbus.transfer import recv_buckets, sole_tensor_bytes, worker_transfer
    from rlbus.transfer.buckets import as_bytes
    from rlbus.transfer.checksum import checksum
    from rlbus.transfer.stream import group_checksum_kind

    torch.set_num_threads(1)
    live = model(size, device)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    rx = worker_transfer(init.backend)
    rx.join(init, 1)
    kind = group_checksum_kind(rx)
    conn.send("joined")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        what = cmd[0]
        reply: dict = {}
        if what == "raw":
            rx.recv(flat).wait()
        else:
            params, buckets = cmd[1], cmd[2]
            deltas = {m.name: m for m in params if m.encoding == "delta"}
            devices: set[str] = set()
            results: dict[str, str] = {}

            def sink(name: str, view: torch.Tensor) -> None:
                devices.add(view.device.type)
                m = deltas.get(name)
                if m is not None:
                    D.write(live[name], view, m)
                    results[name] = checksum(as_bytes(live[name]), kind)
                elif view.data_ptr() != live[name].data_ptr():
                    live[name].copy_(view)

            reply["sums"] = recv_buckets(
                rx,
                params,
                buckets,
                sink,
                landing=lambda b, metas: sole_tensor_bytes(metas, b.nbytes, live),
                into=live,
            )
            reply["devices"] = sorted(devices)
            reply["results"] = results
        sync(device)
        reply["t"] = time.monotonic()
        conn.send(reply)
    rx.close()


# --- the trainer ----------------------------------------------------------------------------


class Check:
    def __init__(self, strict: bool) -> None:
        self.strict, self.failed = strict, 0

    def line(self, name: str, ok: bool, detail: str, enforced: bool = True) -> None:
        mark = "PASS" if ok else ("FAIL" if enforced else "INFO")
        if not ok and enforced:
            self.failed += 1
        print(f"{mark} {name}: {detail}", flush=True)


def one_device(check: Check, device: str, reps: int, size: int) -> None:
    """The kernels on one device: the device checksum against the host's digest, a delta round
    trip against a base on the device and in pinned host memory, and their throughput against
    a copy of the same bytes on the device (reported, not enforced)."""
    from rlbus.schemas import ParamMeta

    from rlbus.transfer import delta as D
    from rlbus.transfer.buckets import as_bytes
    from rlbus.transfer.checksum import device_checksum

    n = size + 13
    host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    buf = host.to(device)
    check.line(
        "device checksum equals the host's", device_checksum(buf) == device_checksum(host), f"{n} bytes on {device}"
    )
    base = model(size, device)
    new = changed(base, 0.01)
    ok = True
    for where in ("device", "pinned") if device == "cuda" else ("device",):
        for name, t in new.items():
            b = base[name] if where == "device" else base[name].cpu().pin_memory()
            k, d, digest = D.diff_checked(t, b, None, "device")
            if d is None or d.blob.device.type != device:
                ok = False
                continue
            out = base[name].clone()
            n_ = d.blob.numel()
            D.write(out, d.blob, d.meta(ParamMeta(name=name, dtype="uint8", shape=[n_], bucket=0, offset=0, nbytes=n_)))
            ok &= torch.equal(D.bits(out), D.bits(t)) and digest == device_checksum(as_bytes(out))
    check.line("device delta round trip bit-identical", ok, f"compare, encode, apply on {device} (1% changed bf16)")

    def timed(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    big = torch.randn(size, device=device).to(torch.bfloat16)
    moved = big.clone()
    moved[::97] = 0  # ~1% of the elements
    raw, dst = big.view(torch.uint8), torch.empty(big.numel() * 2, dtype=torch.uint8, device=device)
    kinds = {
        "copy": lambda: dst.copy_(raw),
        "checksum": lambda: device_checksum(raw),
        "compare": lambda: D.diff_checked(moved, big, None, "device"),
    }
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(reps + 1):
        for kind, fn in kinds.items():
            best[kind] = min(best[kind], timed(fn))
    nb = raw.numel()
    check.line(
        "device checksum throughput",
        False,
        f"{nb / best['checksum'] / 1e9:.2f} GB/s = {best['copy'] / best['checksum']:.2f}x a copy on {device} "
        f"({nb / best['copy'] / 1e9:.2f} GB/s)",
        enforced=False,
    )
    check.line(
        "device compare throughput",
        False,
        f"{2 * nb / best['compare'] / 1e9:.2f} GB/s of both copies = {2 * best['copy'] / best['compare']:.2f}x a copy "
        f"(compare + encode + result checksum, 1% changed)",
        enforced=False,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--size-mb", type=int, default=0, help="model size (default: 1024 on cuda, 32 on cpu)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--changed", type=float, default=0.005, help="fraction of elements changed for the delta")
    ap.add_argument("--base", choices=["device", "pinned"], default="device", help="where the committed copy lives")
    ap.add_argument("--bucket-mb", type=int, default=0, help="default: 256 on cuda (nccl), 16 on cpu (gloo)")
    ap.add_argument("--strict", action="store_true", help="enforce the speed goals on cpu too")
    a = ap.parse_args()
    check = Check(a.strict)
    device = a.device
    torch.set_num_threads(1)
    size = (a.size_mb or (1024 if device == "cuda" else 32)) * MiB
    if device == "cuda":
        if not torch.cuda.is_available():
            check.line("cuda", False, "no CUDA device")
            return 1
        torch.cuda.set_device(0)
        one_device(check, device, a.reps, min(size, 256 * MiB))
        if torch.cuda.device_count() < 2:
            for name in ("bytes stay on the device", "bucket checksums agree", "delta results bit-identical"):
                print(f"SKIP {name} (nccl): needs two CUDA devices (NCCL refuses two ranks on one GPU); found 1")
            print("SKIP dense push vs raw broadcast (nccl): needs two CUDA devices")
            print("SKIP delta push vs dense push (nccl): needs two CUDA devices")
            return 1 if check.failed else 0
        backend = "nccl"
    else:
        backend = "gloo"
        os.environ["RLBUS_CHECKSUM"] = "device"  # the NCCL path's checks, on the host
        os.environ["RLBUS_DELTA"] = "device"
        one_device(check, device, 1, size)
    bucket = (a.bucket_mb or (256 if device == "cuda" else 16)) * MiB
    enforce_speed = device == "cuda" or a.strict

    from rlbus.schemas import TransferInit

    from rlbus.transfer import delta as D
    from rlbus.transfer import prepare, send_stream, trainer_transfer
    from rlbus.transfer.buckets import as_bytes
    from rlbus.transfer.checksum import checksum
    from rlbus.transfer.stream import group_checksum_kind, scratch_bytes, scratch_pair

    base = model(size, device)
    new = changed(base, a.changed)
    committed = {
        n: (t.clone() if a.base == "device" or device == "cpu" else t.cpu().pin_memory()) for n, t in base.items()
    }
    flat = torch.ones(size, dtype=torch.uint8, device=device)
    tx = trainer_transfer(backend)  # type: ignore[arg-type]
    init = tx.bind(
        TransferInit(backend=backend, world_size=2, group_name=f"device-paths-{uuid.uuid4().hex[:8]}", timeout_s=120)
    )
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    env_gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cuda":  # the receiver gets the last GPU as its cuda:0; the trainer keeps cuda:0
        visible = (env_gpu or ",".join(str(i) for i in range(torch.cuda.device_count()))).split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[-1]
    proc = ctx.Process(target=receiver, args=(there, init, device, size), daemon=True)
    proc.start()
    if device == "cuda":
        if env_gpu is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_gpu
        torch.cuda.set_device(0)
    try:
        tx.open(init)
        assert here.recv() == "joined"
        kind = group_checksum_kind(tx)
        named = list(base.items())
        dense_plan = prepare(named, bucket)
        scratch = scratch_pair(tx, scratch_bytes(dense_plan, named))
        print(
            f"device {device} ({backend}), {size / MiB:.0f} MiB bf16 in {len(base)} tensors, bucket {bucket / MiB:.0f} MiB, "
            f"checksum {kind}, delta base on {a.base if device == 'cuda' else 'cpu'}, "
            f"{a.changed:.2%} changed, best of {a.reps}",
            flush=True,
        )

        def raw() -> float:
            here.send(("raw",))
            t0 = time.monotonic()
            tx.send(flat).wait()
            sync(device)
            return here.recv()["t"] - t0

        def dense() -> tuple[float, dict, list[str]]:
            here.send(("dense", dense_plan.params, dense_plan.buckets))
            t0 = time.monotonic()
            sums = send_stream(tx, dense_plan, named, scratch=scratch)
            sync(device)
            got = here.recv()
            return got["t"] - t0, got, sums

        def delta() -> tuple[float, dict, list[str], dict[str, str], int, int]:
            t0 = time.monotonic()
            sending, metas, want, k, n = [], {}, {}, 0, 0
            for name, t in new.items():
                c, d, digest = D.diff_checked(t, committed[name], None, kind)
                k, n = k + c, n + t.numel()
                if c == 0:
                    continue
                if d is None:
                    sending.append((name, t))
                    continue
                sending.append((name, d.blob))
                metas[name], want[name] = d, digest
            p = prepare(sending, bucket)
            per_bucket = [[metas[m.name].meta(m) if m.name in metas else m for m in ms] for ms in p.per_bucket]
            params = [m for ms in per_bucket for m in ms]
            here.send(("delta", params, p.buckets))
            sums = send_stream(tx, p, sending, scratch=scratch)
            sync(device)
            got = here.recv()
            return got["t"] - t0, got, sums, want, k, n

        best = {"raw": float("inf"), "dense": float("inf"), "delta": float("inf")}
        same, on_device, results_ok, unchanged = True, True, True, 1.0
        for rep in range(a.reps + 1):
            took = {"raw": raw()}
            took["dense"], got, sums = dense()  # also brings the receiver back to the base
            same &= got["sums"] == sums
            on_device &= got["devices"] == [device]
            took["delta"], got, sums, want, k, n = delta()
            same &= got["sums"] == sums
            on_device &= got["devices"] == [device]
            results_ok &= got["results"] == want and bool(want)
            unchanged = 1 - k / n
            if rep:
                best = {key: min(best[key], took[key]) for key in best}
        check.line("bytes stay on the device", on_device, f"the receiver's views are on {device}")
        check.line("bucket checksums agree", same, f"{kind} checksums: trainer == receiver, dense and delta")
        results = sum(checksum(as_bytes(t), kind) == want.get(n_) for n_, t in new.items() if n_ in want)
        check.line(
            "delta results bit-identical",
            results_ok and results == len(want),
            f"{len(want)} tensors rebuilt from deltas hash to the trainer's on both ends",
        )
        r_dense = best["raw"] / best["dense"]
        check.line(
            "dense push vs raw broadcast",
            r_dense >= 0.9,
            f"{r_dense:.2f}x raw (goal >= 0.9; raw {best['raw'] * 1e3:.1f} ms, dense {best['dense'] * 1e3:.1f} ms)",
            enforced=enforce_speed,
        )
        r_delta = best["dense"] / best["delta"]
        check.line(
            "delta push vs dense push",
            r_delta >= 10 and unchanged >= 0.99,
            f"{r_delta:.2f}x dense (goal >= 10 at >= 99% unchanged: {unchanged:.2%}; delta {best['delta'] * 1e3:.1f} ms "
            f"incl. compare + encode)",
            enforced=enforce_speed,
        )
        here.send(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        tx.close()
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
