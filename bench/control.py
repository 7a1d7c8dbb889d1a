"""Control-plane benchmark: rlbus pause+resume rounds against a raw NATS scatter-gather.

    python bench/control.py [--workers 1,8,64,256] [--rounds 40] [--per-conn 16] [--profile 64]
                            [--engine weightless|reference]

For each fleet size N, in one process on one event loop, against one embedded nats-server:
  rlbus  a ControllerService and N real WorkerServices (engine: bench/weightless.py, so no
         torch work; --engine reference: the reference engine `rlbus worker` runs, each worker a
         TinyLM with the 256 tensors of the README's 1 GiB model, tiny ones, so that what the
         engine does per command, such as its status, is in the round); one round =
         RLClient.pause("abort") + RLClient.resume(), i.e. trainer -> controller -> N workers ->
         controller -> trainer, twice.
  raw    the same shape with no rlbus code: a "controller" subscriber that, per request,
         nc.request()s N raw responders concurrently (asyncio.gather) and replies once all
         answered; the client sends 2 sequential requests per round. Payload sizes match
         rlbus's (command, WorkerAck, FleetAck), and the connections are laid out the same.
Workers share NATS connections round-robin (--per-conn workers per connection), in both.
Both fleets run at once and the rounds alternate between them (and the sessions) in short
blocks, so a slow spell of a shared machine hits all alike. Median ms per round over --rounds after 3 warm-up rounds;
ratio = rlbus / raw (1.0 = the limit).
kv put: one fsync'd JetStream KV put on the same server (sync_interval: always), timed between
the blocks. The SDK's first send of a pause or a resume says so (a header: no earlier run of
its id exists), so its claim (what makes a resend run once) lands beside its fan-out, as a
session's start and finish send theirs; a session's decision is the one write it waits for in
series. Every answer is sent to the store ahead of the reply on the same connection and
acknowledged after it (services/endpoints.py), so it costs the reply no round trip.
raw+writes: the raw fleet's subscriber also makes those three fsync'd writes per command with
nats-py's KV alone, the same way (claim and desired state beside the scatter-gather, the answer
ahead of the reply); "floor" = raw+writes / raw: what the writes every pause and resume keeps
cost by themselves on this machine (their round trips are hidden, not the client's and the
server's work on the shared cores), which no control-plane code can go under while it keeps them.
--profile N: also cProfile the rlbus rounds at N and print where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.metadata
import io
import math
import os
import platform
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nats
from nats.js.api import KeyValueConfig, StorageType
from rlbus.schemas import PauseWorker, Subjects, WorkerAck, encode
from rlbus.services.controller.service import ControllerOptions, ControllerService
from rlbus.services.worker.engine import Engine
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions, WorkerService
from weightless import WeightlessEngine

from rlbus.bus.connection import connect
from rlbus.models.tinylm import ModelConfig
from rlbus.runners.natsserver import NatsServer
from rlbus.sdk.client import RLClient

WARMUP = 3
BLOCKS = 20
"""Rounds alternate between rlbus, raw and the session in this many blocks each (short blocks:
a slow spell of the shared machine falls on all of them alike)."""
GOAL_NS, GOAL_RATIO, GOAL_SESSION = (8, 64), 1.3, 2.0
"""Issue #27: a round <= 1.3x raw at N = 8 and 64; an empty session <= 2x its raw equivalent."""
KV_PUTS = 10
"""KV puts timed after each block."""
REFERENCE_MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=21, n_heads=4, max_seq_len=16)
"""--engine reference: 21 layers, so 256 tensors as in the 1 GiB TinyLM bench/push.py pushes
(what an engine does per tensor is in the round), of a few KiB each (64 of them fit in memory)."""


def make_engine(kind: str) -> Engine:
    return ReferenceEngine(REFERENCE_MODEL, max_concurrency=1) if kind == "reference" else WeightlessEngine()


@contextmanager
def worker_side(sides: dict[str, list]) -> Iterator[dict[str, float]]:
    """Seconds spent inside the workers' command callbacks, per kind (rlbus: nats.micro's
    wrapper, decode, reply cache, fence, engine, state, encode, the reply's publish; raw: the
    reply's publish), while the block runs: the callbacks of every worker subscription of each
    kind's worker connections are wrapped for the block only (a bench-only patch; the same one
    on both sides)."""
    spent = dict.fromkeys(sides, 0.0)
    wrapped = []
    for kind, conns in sides.items():
        for nc in conns:
            for sub in list(nc._subs.values()):
                if sub._cb is None or ".worker." not in sub.subject:
                    continue

                async def timed(msg, cb=sub._cb, kind=kind) -> None:
                    began = time.perf_counter()
                    await cb(msg)
                    spent[kind] += time.perf_counter() - began

                wrapped.append((sub, sub._cb))
                sub._cb = timed
    try:
        yield spent
    finally:
        for sub, cb in wrapped:
            sub._cb = cb


class Result:
    def __init__(self, per_round: list[float], sizes: dict[str, int], note: str = "") -> None:
        self.per_round = per_round
        self.sizes = sizes
        self.note = note

    @property
    def median_ms(self) -> float:
        return statistics.median(self.per_round) * 1e3


class Side:
    """One side of the comparison, set up and ready: ``round()`` runs one round."""

    round: Callable[[], Awaitable[None]]
    session_round: Callable[[], Awaitable[None]] | None = None
    """rlbus only: start_weight_update + finish_weight_update with no tensors."""
    sizes: dict[str, int]
    note: str = ""
    conns: list = []
    """The workers' NATS connections."""


async def _conns(url: str, n: int, per_conn: int, tag: str) -> list:
    return [await connect(url, name=f"bench-{tag}-{k}") for k in range(max(1, math.ceil(n / per_conn)))]


async def _timed(one_round, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await one_round()
        times.append(time.perf_counter() - t0)
    return times


async def _discovered(nc, name: str, wait: float = 0.5) -> int:
    """How many micro service instances answer $SRV.PING.<name>."""
    inbox = nc.new_inbox()
    got = []

    async def on_pong(msg) -> None:
        got.append(msg)

    sub = await nc.subscribe(inbox, cb=on_pong)
    await nc.publish(f"$SRV.PING.{name}", b"", reply=inbox)
    await asyncio.sleep(wait)
    await sub.unsubscribe()
    return len(got)


@asynccontextmanager
async def rlbus_fleet(url: str, n: int, per_conn: int, engine: str = "weightless") -> AsyncIterator[Side]:
    """A controller and n real WorkerServices on one event loop, and a trainer's RLClient."""
    subjects = Subjects(prefix=f"b{n}x{uuid.uuid4().hex[:6]}")
    ctrl_nc = await connect(url, name="bench-controller")
    trainer_nc = await connect(url, name="bench-trainer")
    wconns = await _conns(url, n, per_conn, "worker")
    controller = ControllerService(ctrl_nc, ControllerOptions(subjects=subjects))
    workers = [
        WorkerService(wconns[i % len(wconns)], make_engine(engine), WorkerOptions(worker_id=f"w{i}", subjects=subjects))
        for i in range(n)
    ]
    rl = RLClient(trainer_nc, subjects=subjects, timeout=60)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(controller.run)
            for w in workers:
                await tg.start(w.run)
            with anyio.fail_after(30):
                await controller.wait_for(lambda reg: len(reg.ids()) >= n)
            found = await _discovered(trainer_nc, "rlbus-worker")
            fleet = Side()

            async def one_round() -> None:
                await rl.pause("abort")
                await rl.resume()

            async def session_round() -> None:
                await rl.start_weight_update()
                await rl.finish_weight_update()  # two-phase: prepare + commit, version kept in KV

            ack = await rl.pause("abort")
            await rl.resume()
            assert len(ack.workers) == n, f"{len(ack.workers)} of {n} workers answered"
            fleet.round, fleet.session_round = one_round, session_round
            fleet.sizes = {
                "command": len(encode(PauseWorker(mode="abort", epoch=1, command_id=uuid.uuid4().hex))),
                "worker_ack": len(encode(WorkerAck(state=workers[0].state()))),
                "fleet_ack": len(encode(ack)),
            }
            fleet.note = f"$SRV.PING: {found}/{n} workers"
            fleet.conns = wconns
            yield fleet
            for w in workers:
                w.stop()
            controller.stop()
    finally:
        for nc in [ctrl_nc, trainer_nc, *wconns]:
            await nc.close()


@asynccontextmanager
async def raw_fleet(
    url: str, n: int, per_conn: int, sizes: dict[str, int], durable: bool = False
) -> AsyncIterator[Side]:
    """The same shape with no rlbus code: raw responders and a scatter-gathering subscriber.
    `durable`: the subscriber also makes the three fsync'd KV writes rlbus makes per pause or
    resume, the way rlbus makes them and with nats-py's KV alone: a claim (a create of the
    command's key) and the desired state (a put) sent as the command arrives and awaited beside
    the scatter-gather, then the answer (a put to the command's key) sent ahead of the reply and
    its acknowledgement awaited after it."""
    prefix = f"raw{n}x{uuid.uuid4().hex[:6]}"
    ctrl_nc = await nats.connect(url, name="raw-controller")
    js = ctrl_nc.jetstream()
    kv = None
    if durable:
        kv = await js.create_key_value(KeyValueConfig(bucket=f"raw_{prefix}", history=1, storage=StorageType.FILE))
    trainer_nc = await nats.connect(url, name="raw-trainer")
    wconns = [await nats.connect(url, name=f"raw-worker-{k}") for k in range(max(1, math.ceil(n / per_conn)))]
    command = b"c" * sizes["command"]
    worker_ack = b"a" * sizes["worker_ack"]
    fleet_ack = b"f" * sizes["fleet_ack"]
    claim, desired, answer = b"c" * 120, b"d" * 200, b"a" * (sizes["fleet_ack"] + 120)
    try:
        for i in range(n):
            nc = wconns[i % len(wconns)]

            async def respond(msg, nc=nc) -> None:
                await nc.publish(msg.reply, worker_ack)

            for op in ("pause", "resume"):
                await nc.subscribe(f"{prefix}.worker.w{i}.{op}", cb=respond)

        async def controller(msg) -> None:
            op = msg.subject.rsplit(".", 1)[1]
            fan_out = (ctrl_nc.request(f"{prefix}.worker.w{i}.{op}", command, timeout=30) for i in range(n))
            if kv is None:
                await asyncio.gather(*fan_out)
                await ctrl_nc.publish(msg.reply, fleet_ack)
                return
            key = uuid.uuid4().hex
            await asyncio.gather(kv.create(key, claim), kv.put("desired", desired), *fan_out)
            answered = await js.publish_async(f"{kv._pre}{key}", answer)  # ahead of the reply
            await ctrl_nc.publish(msg.reply, fleet_ack)
            await answered

        await ctrl_nc.subscribe(f"{prefix}.control.*", cb=controller)
        for nc in [ctrl_nc, *wconns]:
            await nc.flush()
        fleet = Side()

        async def one_round() -> None:
            await trainer_nc.request(f"{prefix}.control.pause", command, timeout=30)
            await trainer_nc.request(f"{prefix}.control.resume", command, timeout=30)

        fleet.round, fleet.sizes, fleet.conns = one_round, sizes, wconns
        yield fleet
    finally:
        if kv is not None:
            await js.delete_key_value(f"raw_{prefix}")
        for nc in [ctrl_nc, trainer_nc, *wconns]:
            await nc.close()


@asynccontextmanager
async def kv_putter(url: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """One put of a state-sized record into a scratch KV bucket (file storage, as rlbus's)."""
    nc = await nats.connect(url, name="bench-kv")
    bucket = f"bench_kv_{uuid.uuid4().hex[:6]}"
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=16, storage=StorageType.FILE))
        record = b"k" * 200

        async def put() -> None:
            await kv.put("desired", record)

        yield put
        await js.delete_key_value(bucket)
    finally:
        await nc.close()


async def measure(
    url: str, n: int, rounds: int, per_conn: int, profiler: cProfile.Profile | None, engine: str = "weightless"
) -> tuple[Result, Result, Result]:
    """Both fleets up at once; rounds alternate between them in blocks (rlbus, raw, rlbus, ...),
    so a slow spell of a shared machine hits both alike; KV puts are timed after each block."""
    async with (
        rlbus_fleet(url, n, per_conn, engine) as rl,
        raw_fleet(url, n, per_conn, rl.sizes) as raw,
        raw_fleet(url, n, per_conn, rl.sizes, durable=True) as durable,
        kv_putter(url) as kv_put,
    ):
        for _ in range(WARMUP):
            await rl.round()
            await raw.round()
            await durable.round()
            await kv_put()
        rl_times: list[float] = []
        raw_times: list[float] = []
        durable_times: list[float] = []
        kv_times: list[float] = []
        session: list[float] = []
        assert rl.session_round is not None
        block = max(1, rounds // BLOCKS)
        while len(rl_times) < rounds:
            k = min(block, rounds - len(rl_times))
            rl_times += await _timed(rl.round, k)
            raw_times += await _timed(raw.round, k)
            durable_times += await _timed(durable.round, k)
            session += await _timed(rl.session_round, k)
            kv_times += await _timed(kv_put, KV_PUTS)
        with worker_side({"rlbus": rl.conns, "raw": raw.conns}) as spent:  # where the gap goes
            for _ in range(rounds):
                await rl.round()
                await raw.round()
        handled = {k: v / rounds for k, v in spent.items()}
        if profiler:
            profiler.enable()
            for _ in range(rounds):
                await rl.round()
            profiler.disable()
    result = Result(rl_times, rl.sizes, note=rl.note)
    result.handled = handled  # type: ignore[attr-defined]
    result.session = Result(session, rl.sizes)  # type: ignore[attr-defined]
    result.durable = Result(durable_times, rl.sizes)  # type: ignore[attr-defined]
    return result, Result(raw_times, rl.sizes), Result(kv_times, {})


def print_profile(profiler: cProfile.Profile, n: int, rounds: int) -> None:
    """Bucket cumulative time by where it is spent (self time, so buckets do not overlap)."""
    st = pstats.Stats(profiler)
    total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
    buckets = {
        "msgspec encode/decode": ("msgspec", "encode", "decode", "codec"),
        "nats-py client (parse, publish, request, inbox mux)": ("/nats/aio/", "/nats/protocol/"),
        "nats.micro handler wrapper": ("/nats/micro/",),
        "asyncio / anyio scheduling": ("asyncio", "anyio", "/selectors.py", "select.epoll", "_contextvars", "sniffio"),
        "rlbus worker (service, engine, handlers)": ("/services/worker/", "/services/handlers.py", "weightless.py"),
        "rlbus controller (service, fan-out, registry)": ("/services/controller/",),
        "rlbus client": ("/rlbus/client.py",),
        "msgspec.structs.replace / uuid / time": ("uuid", "replace", "time"),
    }
    acc = {k: 0.0 for k in buckets}
    acc["other"] = 0.0
    for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        key = f"{file}:{func}"
        for name, marks in buckets.items():
            if any(m in key for m in marks):
                acc[name] += tt
                break
        else:
            acc["other"] += tt
    print(
        f"\nprofile of {rounds} extra rlbus rounds at N={n} (self time; cProfile inflates per-call cost, so read shares):"
    )
    for name, t in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {name:52s} {t / rounds * 1e3:7.2f} ms/round  {t / total:5.1%}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    print("\n  top functions by self time:")
    for line in out.getvalue().splitlines():
        if line.strip() and ("{" in line or "/" in line or "ncalls" in line):
            print("  " + line[:150])


async def amain(a: argparse.Namespace) -> None:
    ns = [int(x) for x in a.workers.split(",")]
    print(
        f"machine: {os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__}, "
        f"nats-py {importlib.metadata.version('nats-py')}, {platform.platform()}"
    )
    print(
        f"rounds {a.rounds} (+{WARMUP} warm-up), round = pause(abort) + resume, "
        f"{a.per_conn} workers per NATS connection, all in one process / event loop; workers' engine: {a.engine}"
    )
    rows = []
    with NatsServer() as server:
        for n in ns:
            prof = cProfile.Profile() if a.profile == n else None
            t0 = time.monotonic()
            rl, raw, kv = await measure(server.url, n, a.rounds, a.per_conn, prof, a.engine)
            rows.append((n, rl, raw, kv))
            print(
                f"  N={n:<4d} done in {time.monotonic() - t0:5.1f}s  ({rl.note}; payload bytes: {rl.sizes})", flush=True
            )
            if prof:
                print_profile(prof, n, a.rounds)
    print()
    print(
        f"{'N':>5} {'rlbus ms/round':>15} {'raw ms/round':>13} {'rlbus/raw':>10} {'session ms':>11} "
        f"{'session/raw':>12} {'kv put ms':>10} {'raw+writes ms':>14} {'floor':>6}   goal"
    )
    for n, rl, raw, kv in rows:
        ratio = rl.median_ms / raw.median_ms
        # a session (start; finish = prepare + commit) is 3 scatter-gathers; raw round is 2
        sess = rl.session.median_ms
        sess_ratio = sess / (raw.median_ms * 3 / 2)
        durable = rl.durable.median_ms  # type: ignore[attr-defined]
        floor = durable / raw.median_ms
        if n in GOAL_NS:
            goal = (
                f"round <= {GOAL_RATIO}x: {'met' if ratio <= GOAL_RATIO else 'MISSED'}, "
                f"session <= {GOAL_SESSION}x: {'met' if sess_ratio <= GOAL_SESSION else 'MISSED'}"
            )
        elif n == 256:
            goal = "works: met"
        else:
            goal = ""
        print(
            f"{n:5d} {rl.median_ms:15.2f} {raw.median_ms:13.2f} {ratio:10.2f} {sess:11.2f} {sess_ratio:12.2f} "
            f"{kv.median_ms:10.2f} {durable:14.2f} {floor:6.2f}   {goal}"
        )
    print(
        f"\n{'N':>5} {'worker us/command':>18} {'raw us/command':>15} {'extra ms/round':>15} {'round without it':>17}"
    )
    for n, rl, raw, _kv in rows:
        commands = 2 * n  # pause and resume, to every worker
        extra = rl.handled["rlbus"] - rl.handled["raw"]  # type: ignore[attr-defined]
        print(
            f"{n:5d} {rl.handled['rlbus'] / commands * 1e6:18.1f} {rl.handled['raw'] / commands * 1e6:15.1f} "  # type: ignore[attr-defined]
            f"{extra * 1e3:15.2f} {(rl.median_ms - extra * 1e3) / raw.median_ms:16.2f}x"
        )
    print(
        "\nsession = start_weight_update + finish_weight_update with no tensors (3 fan-outs and the state writes);"
        " its raw limit is taken as 1.5 raw rounds (3 scatter-gathers).\n"
        "raw+writes = the raw round with the three fsync'd KV writes rlbus keeps per pause or resume (the claim and"
        " the desired state beside the scatter-gather, the answer ahead of the reply, acknowledged after it), made"
        " with nats-py's KV; floor = raw+writes / raw: what those writes cost by themselves here.\n"
        "worker us/command = time inside a worker's command handler, from the message handed to it to its reply"
        " published (rlbus: decode, reply cache, fence, engine, state, encode; raw: the publish alone), over a"
        " pass of rounds after the timed ones; round without it = the rlbus round less that extra, over raw: what"
        " it would be if rlbus's worker path cost what a raw responder's does (every worker shares this one"
        " process, so its path adds to the round once per worker)."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,8,64,256")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--per-conn", type=int, default=16, help="workers sharing one NATS connection")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the rlbus rounds at this N")
    ap.add_argument(
        "--engine",
        default="weightless",
        choices=["weightless", "reference"],
        help="the workers' engine: no torch work, or the reference engine with 256 small tensors",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    anyio.run(amain, a)


if __name__ == "__main__":
    main()
