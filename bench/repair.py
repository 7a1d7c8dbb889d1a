"""Repair: a worker that is behind the committed weights gets them from a healthy peer.

    python bench/repair.py [--size-mb 1024] [--reps 3] [--bucket-mb 64] [--update-mode staged]

A real fleet (controller and worker processes hosting a TinyLM of --size-mb, gloo): the
trainer pushes once, then a new worker process (other initial weights) joins and is repaired
by a peer, --reps times (the new worker is stopped and started again each time). Its repair
time (as the controller measures it: manifest, group, metadata, bytes, verify, commit; from
the worker_repaired event) against the raw limit measured in the same run: one flat gloo
broadcast of the same bytes to one receiver process. Goal: repair >= 0.5x raw.

Then the time a frozen-then-thawed worker takes to serve again: one worker is frozen
(SIGSTOP) past the liveness timeout while the trainer pushes, then continued (SIGCONT); printed
is the time from SIGCONT until it serves the committed version again (rejoin, sync, repair).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from pathlib import Path

import anyio
import msgspec
import torch

sys.path.insert(0, str(Path(__file__).parent))
from memory import config_for
from push import worker_flags
from rlbus.schemas import FleetEvent, event_decoder
from transfer import ReceiverPool

from rlbus.models.tinylm import TinyLM
from rlbus.runners.launcher import ProcessFleet
from rlbus.runners.natsserver import NatsServer

MiB = 1 << 20


def detail_of(ev: FleetEvent) -> dict[str, str]:
    return dict(part.split("=", 1) for part in ev.detail.split() if "=" in part)


async def measure(url: str, a: argparse.Namespace, nbytes: int) -> dict[str, float]:
    cfg = config_for(a.size_mb)
    flags = worker_flags(cfg, a.update_mode)
    fleet = ProcessFleet(url, 2, flags, log_level="WARNING")
    raw = ReceiverPool(1)
    fleet.start()
    out: dict[str, float] = {"repair": float("inf"), "raw": float("inf"), "thaw": float("nan")}
    try:
        rl = await fleet.wait_ready()
        rl.timeout = 300
        named = [(n, p.detach()) for n, p in TinyLM(msgspec.structs.replace(cfg, seed=5)).named_parameters()]
        await rl.push_weights(named, "bench-repair-0", bucket_bytes=a.bucket_mb * MiB)
        repaired = await rl.nc.subscribe(rl.subjects.event("worker_repaired"))
        flat = torch.ones(nbytes, dtype=torch.uint8)
        for rep in range(a.reps):
            out["raw"] = min(
                out["raw"],
                await anyio.to_thread.run_sync(
                    lambda: raw.run(1, "gloo", "raw", 1, lambda tx: tx.send(flat).wait(), sizes=[flat.numel()])
                ),
            )
            name = f"new-{rep}"
            fleet._spawn(name, ["worker", "--nats-url", url, "--id", name, *flags, "--seed", str(100 + rep)])
            with anyio.fail_after(600):
                while True:
                    ev = event_decoder.decode((await repaired.next_msg(timeout=600)).data)
                    if isinstance(ev, FleetEvent) and name in ev.workers:
                        break
            out["repair"] = min(out["repair"], float(detail_of(ev)["seconds"]))
            fleet.procs[name].terminate()
            fleet.procs.pop(name).wait(60)
            phases = detail_of(ev).get("phases", "")
            print(f"  rep {rep}: repaired {name} in {float(detail_of(ev)['seconds']):.2f}s ({phases})", flush=True)

        # frozen past the liveness timeout while a push commits, then thawed
        frozen = fleet.procs["worker-1"]
        frozen.send_signal(signal.SIGSTOP)
        with anyio.fail_after(120):
            # polls the controller until it dropped the frozen worker
            while "worker-1" in [w.worker_id for w in (await rl.server_info()).workers]:  # noqa: ASYNC110
                await anyio.sleep(0.1)
        await rl.push_weights([(n, t + 1) for n, t in named], "bench-repair-1", bucket_bytes=a.bucket_mb * MiB)
        frozen.send_signal(signal.SIGCONT)
        thawed = time.monotonic()
        with anyio.fail_after(600):
            while True:
                info = await rl.server_info()
                w = next((w for w in info.workers if w.worker_id == "worker-1"), None)
                if w is not None and not w.state.withheld and w.state.weight_seq == info.weight_seq:
                    break
                await anyio.sleep(0.02)  # poll period of the measurement
        out["thaw"] = time.monotonic() - thawed
        await repaired.unsubscribe()
        await rl.close()
        return out
    finally:
        fleet.stop()
        raw.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64, help="the trainer's push (a repair plans its own buckets)")
    ap.add_argument(
        "--update-mode",
        choices=["staged", "in_place"],
        default="staged",
        help="the workers' mode (a withheld worker repairs in place either way)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = config_for(a.size_mb)
    nbytes = sum(p.numel() * p.element_size() for p in TinyLM(cfg).parameters())
    print(
        f"machine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}, torch {torch.__version__}"
    )
    print(f"model tinylm: {nbytes / MiB:.0f} MiB; repair of one new worker from a peer, best of {a.reps}")
    with NatsServer() as server:
        b = anyio.run(measure, server.url, a, nbytes)
    print(f"\n{'raw GB/s':>9} {'repair GB/s':>12} {'repair/raw':>11} {'thaw->serving s':>16}   goal: repair/raw >= 0.5")
    print(
        f"{nbytes / b['raw'] / 1e9:9.2f} {nbytes / b['repair'] / 1e9:12.2f} {b['raw'] / b['repair']:11.2f} {b['thaw']:16.2f}"
    )


if __name__ == "__main__":
    main()
