"""Data-plane benchmark: rlbus buckets against the raw limits of the same transports.

    python bench/transfer.py [--size-mb 1024] [--receivers 1,2,3] [--reps 3]

For each receiver count R (receivers are separate processes) it measures
  raw    one flat uint8 tensor of S bytes broadcast over gloo
  rlbus  the stream (plan; pack and hash bucket k+1 while bucket k is on the wire; the
         digests; receive, verify, sink copy) of a ~200-tensor mixed-size model of S bytes
         over gloo
  naive  one broadcast per tensor of a ~1000-small-tensor model, against rlbus on it
  shm    S bytes through the shm backend, against S bytes memcpy'd into each of R
         buffers by R threads at once: from the trainer's shared pool (the transport
         alone), through its two slots, and the whole rlbus stream of the 200-tensor model
and prints GB/s plus the ratios rlbus/raw, rlbus/naive, shm/memcpy (throughput;
1.0 = as fast as the reference). First, on this host's CPU (--ops-mb; what CI runs of the
paths GPU tensors take over NCCL): the device checksum and the device (torch) delta compare
against a memcpy of the same bytes, beside xxh3 and numpy's host compare. Times run from the trainer's start to the last
receiver's finish (same-host monotonic clock), best of --reps, each after one warm-up;
every kind is measured in turn within a rep, so drift on a shared machine hits all alike.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import msgspec
import torch
from rlbus.schemas import BucketMeta, ParamMeta, TransferInit

from rlbus.transfer import (
    prepare,
    recv_buckets,
    send_all,
    send_stream,
    sole_tensor_bytes,
    trainer_transfer,
    worker_transfer,
)
from rlbus.transfer.buckets import as_bytes, torch_dtype
from rlbus.transfer.checksum import checksum
from rlbus.transfer.stream import alloc_buffers, scratch_bytes
from rlbus.transfer.torchdist import TorchDistTrainer, TorchDistWorker

BUCKET = 16 << 20
SHM_BUCKET = 128 << 20


def mixed_model(total: int, count: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """``count`` tensors (fp32/bf16, sizes spread over two decades) of about ``total`` bytes."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=g) ** 3 + 0.01
    sizes = (weights / weights.sum() * total).long().clamp(min=64)
    named = []
    for i, nbytes in enumerate(sizes.tolist()):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        n = max(1, nbytes // dtype.itemsize)
        named.append((f"t{i}", torch.empty(n, dtype=dtype).fill_(i % 7)))
    return named


# --- worker process -----------------------------------------------------------------


def worker_main() -> None:
    """Serve one command per stdin line; answer the finish time on stdout. The buffers of a
    command are freed (and handed back to the OS) before the next: an idle receiver holds none."""
    for line in sys.stdin:
        serve_one(json.loads(line))
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


BASELINES = ("raw", "chunked", "landed", "naive")
"""The kinds that measure a limit rather than rlbus: over gloo they move every buffer as one
broadcast, the plain torch.distributed way, whatever rlbus's groups default to."""


def transfer_for(backend: str, kind: str, trainer: bool):
    """The transfer a kind runs over: rlbus's own, or broadcasts for a gloo baseline."""
    if backend == "gloo" and kind in BASELINES:
        return TorchDistTrainer("gloo", broadcasts=True) if trainer else TorchDistWorker("gloo", broadcasts=True)
    return trainer_transfer(backend) if trainer else worker_transfer(backend)  # type: ignore[arg-type]


def serve_one(cmd: dict) -> None:
    init = msgspec.json.decode(cmd["init"].encode(), type=TransferInit)
    rx = transfer_for(init.backend, cmd["kind"], trainer=False)
    kind = cmd["kind"]
    if kind in ("raw", "shm", "chunked"):
        bufs = alloc_buffers(max(cmd["sizes"]), 1 if len(cmd["sizes"]) == 1 else 2)
    elif kind == "landed":
        whole = alloc_buffers(sum(cmd["sizes"]), 1)[0]  # memory the size of the model, pages touched
    elif kind == "rlbus":
        params = msgspec.json.decode(cmd["params"].encode(), type=list[ParamMeta])
        buckets = msgspec.json.decode(cmd["buckets"].encode(), type=list[BucketMeta])
        dst = {m.name: torch.zeros(m.shape, dtype=torch_dtype(m.dtype)) for m in params}
        scratch = alloc_buffers(max(b.nbytes for b in buckets))
    else:  # naive
        dst_list = [torch.zeros(n, dtype=torch.uint8) for n in cmd["sizes"]]
    rx.join(init, cmd["rank"])
    for _ in range(cmd["reps"]):
        if kind in ("raw", "shm"):
            for k, n in enumerate(cmd["sizes"]):
                rx.recv(bufs[k % 2][:n]).wait()
        elif kind in ("chunked", "landed"):
            # as rlbus's receiver does (stream.RECV_DEPTH): chunk k+1 posted while chunk k arrives,
            # chunk k hashed while k+1 arrives, then k+2 posted into k's buffer
            sizes, offs = cmd["sizes"], [0]
            for n in sizes:
                offs.append(offs[-1] + n)

            def chunk(k: int) -> torch.Tensor:  # chunked: two reused buffers; landed: where the model keeps it
                return bufs[k % 2][: sizes[k]] if kind == "chunked" else whole[offs[k] : offs[k + 1]]

            posted = [rx.recv(chunk(k)) for k in range(min(2, len(sizes)))]
            for k in range(len(sizes)):
                posted.pop(0).wait()
                checksum(chunk(k))
                if k + 2 < len(sizes):
                    posted.append(rx.recv(chunk(k + 2)))
        elif kind == "rlbus":
            # as an in_place worker does: a bucket that is one tensor lands in it directly
            recv_buckets(
                rx,
                params,
                buckets,
                lambda n, v: None if v.data_ptr() == dst[n].data_ptr() else dst[n].copy_(v),
                scratch=scratch,
                landing=lambda b, metas: sole_tensor_bytes(metas, b.nbytes, dst),
                into=dst,
            )
        else:
            for d in dst_list:
                rx.recv(d).wait()
        print(json.dumps({"t": time.monotonic()}), flush=True)
    rx.close()
    # Freed before the next kind runs, and said so (ReceiverPool.run waits for it): freeing memory
    # the size of the model (raw's buffer, landed's) is kernel work on the shared cores, and it
    # ran inside the next kind's timed push (the same rlbus push run twice in a row: the second
    # 10 % faster at R = 2, 2026-12-07).
    bufs = whole = dst = scratch = dst_list = None
    gc.collect()
    print(json.dumps({"released": time.monotonic()}), flush=True)


# --- trainer ------------------------------------------------------------------------


class ReceiverPool:
    def __init__(self, n: int, threads: int = 1, env: dict[str, str] | None = None) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", "--threads", str(threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, **(env or {})),
            )
            for _ in range(n)
        ]

    def run(self, r: int, backend: str, kind: str, reps: int, send, **extra) -> float:
        """Best seconds from trainer start to the last receiver's finish, over reps (after a warm-up)."""
        tx = transfer_for(backend, kind, trainer=True)
        init = tx.bind(
            TransferInit(
                backend=backend,
                world_size=r + 1,  # type: ignore[arg-type]
                group_name=f"bench-{uuid.uuid4().hex[:8]}",
                timeout_s=120,
            )
        )
        for rank, p in enumerate(self.procs[:r], start=1):
            assert p.stdin is not None
            p.stdin.write(
                json.dumps(
                    {"kind": kind, "init": msgspec.json.encode(init).decode(), "rank": rank, "reps": reps + 1, **extra}
                )
                + "\n"
            )
            p.stdin.flush()
        tx.open(init)
        best = float("inf")
        for rep in range(reps + 1):
            t0 = time.monotonic()
            send(tx)
            ends = [json.loads(p.stdout.readline())["t"] for p in self.procs[:r]]  # type: ignore[union-attr]
            if rep:
                best = min(best, max(ends) - t0)
        tx.close()
        for p in self.procs[:r]:  # every receiver has let its memory go: none of it runs in the next kind
            json.loads(p.stdout.readline())["released"]  # type: ignore[union-attr]
        return best

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(30)


def send_chunked(tx, flat: torch.Tensor, chunk: int) -> None:
    """The bare protocol-free baseline of a checksummed push: ``flat`` as broadcasts of
    ``chunk`` bytes, each hashed (xxh3-128) just before it leaves, at most two in flight."""
    window = []
    for off in range(0, flat.numel(), chunk):
        buf = flat[off : off + chunk]
        checksum(buf)
        if len(window) == 2:
            window.pop(0).wait()
        window.append(tx.send(buf))
    for h in window:
        h.wait()


def chunk_sizes(nbytes: int, chunk: int) -> list[int]:
    return [min(chunk, nbytes - off) for off in range(0, nbytes, chunk)]


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def device_ops(nbytes: int, reps: int) -> None:
    """The device paths' kernels run on the host: the device checksum and the torch delta
    compare (+ encode) of a bf16 tensor with ~1% of its elements changed, against a memcpy of
    the same bytes (the compare reads two copies: against two memcpys' worth of reading),
    measured in turn, best of ``reps``; xxh3 and numpy's host compare beside them."""
    from rlbus.transfer import delta as D
    from rlbus.transfer.checksum import device_checksum

    g = torch.Generator().manual_seed(0)
    n = nbytes // 2
    base = torch.randn(n, generator=g).to(torch.bfloat16)
    new = base.clone()
    hit = torch.randint(0, n, (n // 100,), generator=g)
    new[hit] = (new[hit].float() * 1.01).to(torch.bfloat16)
    src, dst = new.view(torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a, b = D.bits(new), D.bits(base)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    kinds = {
        "memcpy": lambda: dst.copy_(src),
        "xxh3": lambda: checksum(src, "xxh3"),
        "device checksum": lambda: device_checksum(src),
        "numpy compare": lambda: D.diff(new, base),
        "device compare": lambda: D._diff_torch(a, b, tuple(new.shape), new.dtype),
    }
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(reps + 1):
        for kind, fn in kinds.items():
            best[kind] = min(best[kind], timed(fn))
    m = best["memcpy"]
    print(
        f"device paths on this CPU ({nbytes >> 20} MiB, 1 torch thread, best of {reps}; ratio = throughput / memcpy's)"
    )
    print(f"  memcpy               {gbps(nbytes, m):6.2f} GB/s")
    for kind in ("xxh3", "device checksum"):
        print(f"  {kind:<20} {gbps(nbytes, best[kind]):6.2f} GB/s   /memcpy = {m / best[kind]:.2f}")
    for kind in ("numpy compare", "device compare"):
        print(
            f"  {kind:<20} {gbps(2 * nbytes, best[kind]):6.2f} GB/s of both copies   "
            f"/memcpy = {2 * m / best[kind]:.2f}   (1% of bf16 elements changed: compare + encode)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="model size (the issue: ~1 GiB)")
    ap.add_argument("--receivers", default="1,2,3")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=16, help="gloo bucket size (RLClient uses 16 MiB on gloo)")
    ap.add_argument("--shm-bucket-mb", type=int, default=128, help="shm bucket size (RLClient uses 128 MiB on shm)")
    ap.add_argument(
        "--only",
        default="",
        help="measure only these kinds (comma-separated): raw, rlbus, naive, "
        "rlbus_small, memcpy, shm, shm_pool, shm_stream",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (rlbus services use 1)")
    ap.add_argument("--ops-mb", type=int, default=256, help="bytes for the device checksum/compare on CPU (0: skip)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    # one intra-op thread per process, as rlbus's services run: with R+1 processes on a few
    # cores, torch's thread pools would only fight over them
    torch.set_num_threads(a.threads)
    if a.worker:
        return worker_main()
    if a.ops_mb:
        device_ops(a.ops_mb << 20, a.reps)
    global BUCKET, SHM_BUCKET
    BUCKET, SHM_BUCKET = a.bucket_mb << 20, a.shm_bucket_mb << 20
    size = a.size_mb << 20
    receivers = [int(x) for x in a.receivers.split(",")]
    flat = torch.ones(size, dtype=torch.uint8)
    big = mixed_model(size, 200, 0)
    small = mixed_model(min(size // 8, 32 << 20), 1000, 1)
    p_big, p_small = prepare(big, BUCKET), prepare(small, BUCKET)
    p_shm = prepare(big, SHM_BUCKET)
    big_bytes = sum(t.numel() * t.element_size() for _, t in big)
    small_bytes = sum(t.numel() * t.element_size() for _, t in small)

    def stream(p, named):
        scratch = alloc_buffers(scratch_bytes(p, named))  # reused every step, as RLClient does

        def send(tx):
            send_stream(tx, p, named, scratch=scratch)

        return send

    def meta(p):
        return {"params": msgspec.json.encode(p.params).decode(), "buckets": msgspec.json.encode(p.buckets).decode()}

    dsts = [torch.zeros(size, dtype=torch.uint8) for _ in range(max(receivers))]

    def memcpy_into_each(r: int) -> float:
        """The shm limit: S bytes copied into each of R destinations, R threads at once."""
        threads = [threading.Thread(target=dsts[i].copy_, args=(flat,)) for i in range(r)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    shm_chunks = [flat[i : i + SHM_BUCKET] for i in range(0, size, SHM_BUCKET)]

    fleet = ReceiverPool(max(receivers), a.threads)
    print(
        f"size {a.size_mb} MiB, gloo bucket {BUCKET >> 20} MiB, shm bucket {SHM_BUCKET >> 20} MiB, "
        f"torch threads {torch.get_num_threads()}, best of {a.reps}, every kind measured in turn per rep"
    )
    try:
        for r in receivers:
            pooled: dict[str, object] = {"tx": None, "views": [], "scratch": []}

            def from_pool(tx):  # the bytes already in the trainer's shared memory: the transport alone
                if pooled["tx"] is not tx:  # a new group each run: its own pool (untimed warm-up rep)
                    pool = tx.alloc(size)
                    pool.copy_(flat)
                    pooled.update(tx=tx, views=[pool[i : i + SHM_BUCKET] for i in range(0, size, SHM_BUCKET)])
                send_all(tx, pooled["views"])

            def shm_stream(tx):  # what RLClient does on shm: pack and hash into shared scratch
                if pooled["tx"] is not tx:
                    need = scratch_bytes(p_shm, big, pack_every_bucket=True)
                    pair = tx.alloc(2 * need)
                    pooled.update(tx=tx, scratch=[pair[:need], pair[need:]])
                send_stream(tx, p_shm, big, scratch=pooled["scratch"], pack_every_bucket=True)

            kinds = {
                "raw": lambda: fleet.run(r, "gloo", "raw", 1, lambda tx: tx.send(flat).wait(), sizes=[size]),
                "rlbus": lambda: fleet.run(r, "gloo", "rlbus", 1, stream(p_big, big), **meta(p_big)),
                "naive": lambda: fleet.run(
                    r,
                    "gloo",
                    "naive",
                    1,
                    lambda tx: [tx.send(as_bytes(t)).wait() for _, t in small],
                    sizes=[t.numel() * t.element_size() for _, t in small],
                ),
                "rlbus_small": lambda: fleet.run(r, "gloo", "rlbus", 1, stream(p_small, small), **meta(p_small)),
                "memcpy": lambda: min(memcpy_into_each(r) for _ in range(2)),
                "shm": lambda: fleet.run(
                    r, "shm", "shm", 1, lambda tx: send_all(tx, shm_chunks), sizes=[c.numel() for c in shm_chunks]
                ),
                "shm_pool": lambda: fleet.run(r, "shm", "shm", 1, from_pool, sizes=[c.numel() for c in shm_chunks]),
                "shm_stream": lambda: fleet.run(r, "shm", "rlbus", 1, shm_stream, **meta(p_shm)),
            }
            if a.only:
                kinds = {k: run for k, run in kinds.items() if k in a.only.split(",")}
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(a.reps):  # in turn, so a slow spell of a shared machine hits every kind alike
                for kind, run in kinds.items():
                    best[kind] = min(best[kind], run())
            b = best
            lines = [
                (["raw"], lambda: f"raw gloo broadcast   {gbps(size, b['raw']):6.2f} GB/s"),
                (
                    ["raw", "rlbus"],
                    lambda: (
                        f"rlbus gloo (200 t)   {gbps(big_bytes, b['rlbus']):6.2f} GB/s   "
                        f"rlbus/raw   = {b['raw'] / b['rlbus'] * big_bytes / size:.2f}"
                    ),
                ),
                (["naive"], lambda: f"naive gloo (1000 t)  {gbps(small_bytes, b['naive']):6.2f} GB/s"),
                (
                    ["naive", "rlbus_small"],
                    lambda: (
                        f"rlbus gloo (1000 t)  {gbps(small_bytes, b['rlbus_small']):6.2f} GB/s   "
                        f"rlbus/naive = {b['naive'] / b['rlbus_small']:.2f}"
                    ),
                ),
                (
                    ["memcpy"],
                    lambda: (
                        f"memcpy into each     {gbps(size, b['memcpy']):6.2f} GB/s   "
                        f"(S bytes into each of {r} buffers, {r} threads)"
                    ),
                ),
                (
                    ["memcpy", "shm"],
                    lambda: (
                        f"shm (slots)          {gbps(size, b['shm']):6.2f} GB/s   "
                        f"shm/memcpy  = {b['memcpy'] / b['shm']:.2f}"
                    ),
                ),
                (
                    ["memcpy", "shm_pool"],
                    lambda: (
                        f"shm (shared pool)    {gbps(size, b['shm_pool']):6.2f} GB/s   "
                        f"shm/memcpy  = {b['memcpy'] / b['shm_pool']:.2f}"
                    ),
                ),
                (
                    ["memcpy", "shm_stream"],
                    lambda: (
                        f"rlbus shm (200 t)    {gbps(big_bytes, b['shm_stream']):6.2f} GB/s   "
                        f"rlbus/memcpy = {b['memcpy'] / b['shm_stream'] * big_bytes / size:.2f}"
                        "   (packs and hashes on the trainer too)"
                    ),
                ),
            ]
            print(f"\nreceivers={r}")
            for needs, line in lines:
                if all(k in best for k in needs):
                    print("  " + line())
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
