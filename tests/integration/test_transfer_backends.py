"""Real gloo groups and real shared memory: trainer + workers as threads and as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import pytest
import torch
from rlbus.schemas import TransferInit

from rlbus.transfer import (
    ChecksumMismatch,
    TransferError,
    TransferTimeout,
    checksum,
    pack_all,
    prepare,
    recv_buckets,
    send_all,
    send_stream,
    sole_tensor_bytes,
    trainer_transfer,
    worker_transfer,
)
from rlbus.transfer.buckets import SOLO_FRACTION, as_bytes
from rlbus.transfer.stream import RECV_DEPTH

CPU_BACKENDS = ["gloo", "shm"]
BUCKET = 4096


def model(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    named: list[tuple[str, torch.Tensor]] = []
    for i in range(12):
        named.append((f"layer{i}.w", torch.randn(17, 13 + i, generator=g)))
        named.append((f"layer{i}.b", torch.randn(13 + i, generator=g).to(torch.bfloat16)))
    named += [
        ("big", torch.randn(3000, generator=g)),  # larger than a bucket
        ("mask", torch.randint(0, 2, (33,), generator=g).bool()),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("ids", torch.randint(-100, 100, (5, 7), generator=g, dtype=torch.int32).t()),
    ]
    return named


def digests(named) -> dict[str, str]:
    return {n: f"{t.dtype}|{list(t.shape)}|{checksum(as_bytes(t).clone())}" for n, t in named}


def new_init(backend: str, workers: int, timeout_s: float = 10.0, group: str | None = None) -> TransferInit:
    return TransferInit(
        backend=backend,
        world_size=workers + 1,  # type: ignore[arg-type]
        group_name=group or f"test-{uuid.uuid4().hex[:8]}",
        timeout_s=timeout_s,
    )


def run_threads(init: TransferInit, trainer: Callable, worker: Callable, workers: int = 2, tx=None) -> list:
    """Bind + open the trainer here (``tx``, else a new one; closed at the end), run
    `worker(rx, rank)` in one thread per worker."""
    tx = tx or trainer_transfer(init.backend)
    bound = tx.bind(init)
    assert bound.master_port != 0
    results: list = [None] * workers

    def body(i: int) -> None:
        rx = worker_transfer(init.backend)
        try:
            rx.join(bound, 1 + i)
            results[i] = worker(rx, 1 + i)
        except BaseException as e:
            results[i] = e
        finally:
            rx.close()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    try:
        tx.open(bound)
        trainer(tx)
    finally:
        for t in threads:
            t.join(init.timeout_s * 2)
        tx.close()
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return results


def collect(params, buckets) -> Callable:
    def worker(rx, rank):
        got: dict[str, torch.Tensor] = {}
        recv_buckets(rx, params, buckets, lambda n, v: got.__setitem__(n, v.clone()))
        return got

    return worker


class Recording:
    """A trainer transport that logs every bucket it is handed (its memory and size)."""

    def __init__(self, tx, log: list) -> None:
        self.tx, self.log = tx, log

    def send(self, buf):
        self.log.append(("send", buf.data_ptr(), buf.numel()))
        return self.tx.send(buf)


class ReadLog(dict):
    """Named tensors that log which one is read, and when."""

    def __init__(self, named, log: list) -> None:
        super().__init__(named)
        self.log = log

    def get(self, name, default=None):
        self.log.append(("read", name))
        return super().get(name, default)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_tensor_travelling_alone_is_sent_from_its_memory_and_lands_in_the_destination(backend):
    named = model()
    bucket = 2 * BUCKET  # every layer's tensors under a quarter of it: "big" alone travels alone
    p = prepare(named, bucket)
    lookup = dict(named)
    solo = {
        ms[0].name
        for ms in p.per_bucket
        if len(ms) == 1 and lookup[ms[0].name].numel() * lookup[ms[0].name].element_size() * SOLO_FRACTION >= bucket
    }
    assert solo == {"big"}
    sent: list = []

    def worker(rx, rank):
        dst = {n: torch.zeros_like(t) for n, t in named}
        copied: set[str] = set()

        def sink(name, view):
            if view.data_ptr() != dst[name].data_ptr():
                dst[name].copy_(view)
                copied.add(name)

        recv_buckets(rx, p.params, p.buckets, sink, landing=lambda b, metas: sole_tensor_bytes(metas, b.nbytes, dst))
        return dst, copied

    for got in run_threads(new_init(backend, 2), lambda tx: send_stream(Recording(tx, sent), p, named), worker):
        assert not isinstance(got, BaseException), got
        dst, copied = got
        assert all(torch.equal(dst[n], t) for n, t in named)
        assert "big" not in copied, "received straight into the destination tensor"
        assert copied == set(lookup) - {"big"}, "shared buckets go through scratch and are copied out"
    assert ("send", lookup["big"].data_ptr(), lookup["big"].numel() * 4) in sent, (
        "sent from the tensor itself, not a copy"
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_tensors_of_shared_buckets_are_copied_straight_into_their_destinations(backend):
    named = model()
    p = prepare(named, BUCKET)

    def worker(rx, rank):
        dst = {n: torch.zeros_like(t) for n, t in named}
        dst["ids"] = torch.zeros(5, 7, dtype=torch.int32).t()  # strided: handed over as a view instead
        handed: dict[str, bool] = {}

        def sink(name, got):
            handed[name] = got is dst[name]
            if not handed[name]:
                dst[name].copy_(got)

        recv_buckets(rx, p.params, p.buckets, sink, into=dst)
        return dst, handed

    for got in run_threads(new_init(backend, 2), lambda tx: send_stream(tx, p, named), worker):
        assert not isinstance(got, BaseException), got
        dst, handed = got
        assert all(torch.equal(dst[n], t) for n, t in named)
        assert {n for n, straight in handed.items() if not straight} == {"ids"}, (
            "every small contiguous tensor was copied into its destination, not handed over as a view"
        )


def test_a_worker_receives_stream_after_stream_into_the_two_buffers_it_keeps():
    """Buckets that land nowhere of their own (shared buckets, a delta's blobs) are received into
    two scratch buffers: a caller that keeps them gets them back filled in, and the next stream
    reuses them instead of allocating and zeroing two more."""
    named = model()
    p = prepare(named, BUCKET)

    def worker(rx, rank):
        kept: list[torch.Tensor] = []
        seen, results = [], []
        for _ in range(2):
            got: dict[str, torch.Tensor] = {}
            recv_buckets(rx, p.params, p.buckets, lambda name, view: got.__setitem__(name, view.clone()), scratch=kept)
            seen.append([b.data_ptr() for b in kept])
            results.append(got)
        return seen, results

    def trainer(tx):
        send_stream(tx, p, named)
        send_stream(tx, p, named)

    for got in run_threads(new_init("gloo", 1), trainer, worker, workers=1):
        assert not isinstance(got, BaseException), got
        seen, results = got
        assert len(seen[0]) == 2 and seen[1] == seen[0]
        for out in results:
            assert digests([(n, out[n].view(t.dtype).view(t.shape)) for n, t in named]) == digests(named)


class PostLog:
    """A worker transport that logs when each receive is posted and when it is waited for."""

    def __init__(self, rx, log: list) -> None:
        self.rx, self.log, self.posted = rx, log, 0

    def __getattr__(self, name):
        return getattr(self.rx, name)

    def recv(self, buf):
        k, self.posted = self.posted, self.posted + 1
        self.log.append(("post", k))
        return WaitLog(self.rx.recv(buf), self.log, k)


class WaitLog:
    """A receive in flight that logs when it is waited for."""

    def __init__(self, handle, log: list, k: int) -> None:
        self.handle, self.log, self.k = handle, log, k

    def wait(self):
        self.log.append(("wait", self.k))
        return self.handle.wait()


def test_a_worker_has_the_next_buckets_receive_posted_before_it_waits_for_one():
    # gloo moves a bucket's bytes only once its receive is posted: posting bucket k+1 only
    # after bucket k arrived left the wire idle between buckets
    named = model()
    p = prepare(named, BUCKET)
    n = len(p.bucket_sizes)
    assert n > 3 and any(len(group) > 1 for group in p.per_bucket), "landed and scratch buckets both"
    log: list = []

    def worker(rx, rank):
        dst = {name: torch.zeros_like(t) for name, t in named}
        kept: list[torch.Tensor] = []
        recv_buckets(
            PostLog(rx, log),
            p.params,
            p.buckets,
            lambda name, v: None if v.data_ptr() == dst[name].data_ptr() else dst[name].copy_(v),
            scratch=kept,
            landing=lambda b, metas: sole_tensor_bytes(metas, b.nbytes, dst),
        )
        return dst, len(kept)

    (got,) = run_threads(new_init("gloo", 1), lambda tx: send_stream(tx, p, named), worker, workers=1)
    assert not isinstance(got, BaseException), got
    dst, buffers = got
    assert digests(dst.items()) == digests(named)
    assert buffers == 2, "two scratch buffers still do"
    at = {e: i for i, e in enumerate(log)}
    for k in range(n - 1):
        assert at[("post", k + 1)] < at[("wait", k)], f"bucket {k + 1} was posted only after bucket {k} arrived"


def test_a_worker_keeps_landing_buckets_posted_deep_ahead_and_at_most_two_in_scratch():
    # a bucket that lands in its own memory costs nothing while it waits: several stay posted
    # (4 MiB buckets one or two at a time left gloo's wire idle); one received into scratch
    # holds one of the two buffers until it was copied out
    named = model()
    p = prepare(named, BUCKET)
    packed = {k for k, group in enumerate(p.per_bucket) if len(group) > 1}
    assert packed and len(p.bucket_sizes) - len(packed) > RECV_DEPTH, "landed and scratch buckets both"
    log: list = []

    def worker(rx, rank):
        dst = {name: torch.zeros_like(t) for name, t in named}
        recv_buckets(
            PostLog(rx, log),
            p.params,
            p.buckets,
            lambda name, v: None if v.data_ptr() == dst[name].data_ptr() else dst[name].copy_(v),
            landing=lambda b, metas: sole_tensor_bytes(metas, b.nbytes, dst),
        )
        return dst

    (dst,) = run_threads(new_init("gloo", 1), lambda tx: send_stream(tx, p, named), worker, workers=1)
    assert not isinstance(dst, BaseException), dst
    assert digests(dst.items()) == digests(named)
    ahead, in_scratch, deepest = set(), set(), 0
    for what, k in log:  # posted until waited for; a scratch buffer held until the next wait starts
        if what == "post":
            ahead.add(k)
            in_scratch |= {k} & packed
            deepest = max(deepest, len(ahead))
            assert len(ahead) <= RECV_DEPTH and len(in_scratch) <= 2, (k, sorted(ahead), sorted(in_scratch))
        else:
            ahead.discard(k)
            in_scratch -= {j for j in in_scratch if j < k}
    assert deepest > 2, "only two receives were ever posted at once"


def test_a_trainer_that_opens_a_new_group_numbers_its_buckets_afresh():
    # a trainer object that closes one group and opens another must not go on counting from the
    # first (a gloo group tags each bucket with its number)
    named = model(2)
    p = prepare(named, BUCKET)
    tx = trainer_transfer("gloo")
    for _ in range(2):
        init = new_init("gloo", 1)
        (got,) = run_threads(init, lambda tx: send_stream(tx, p, named), collect(p.params, p.buckets), 1, tx=tx)
        assert not isinstance(got, BaseException), got
        assert all(torch.equal(got[n].view(t.dtype).view(t.shape), t) for n, t in named)


def test_over_shm_a_worker_reads_buckets_where_they_lie_and_copies_each_byte_once():
    named = model()
    p = prepare(named, BUCKET)

    def worker(rx, rank):
        scratch = [torch.zeros(p.max_bucket, dtype=torch.uint8) for _ in range(2)]
        dst = {n: torch.zeros_like(t) for n, t in named}
        dst["ids"] = torch.zeros(5, 7, dtype=torch.int32).t()
        recv_buckets(
            rx, p.params, p.buckets, lambda n, v: None if v is dst[n] else dst[n].copy_(v), scratch=scratch, into=dst
        )
        return dst, scratch

    for got in run_threads(new_init("shm", 2), lambda tx: send_stream(tx, p, named), worker):
        assert not isinstance(got, BaseException), got
        dst, scratch = got
        assert all(torch.equal(dst[n], t) for n, t in named)
        assert not any(b.any() for b in scratch), "no bucket was copied into a receive buffer first"


def test_the_stream_sends_its_first_bucket_before_it_packs_the_last():
    named = model()
    p = prepare(named, BUCKET)
    assert len(p.bucket_sizes) > 3
    log: list = []
    run_threads(
        new_init("gloo", 1),
        lambda tx: send_stream(Recording(tx, log), p, ReadLog(named, log)),
        collect(p.params, p.buckets),
        workers=1,
    )
    first_send = next(i for i, e in enumerate(log) if e[0] == "send")
    last_name = p.per_bucket[-1][-1].name
    last_read = max(i for i, e in enumerate(log) if e == ("read", last_name))
    assert first_send < last_read, "bucket 0 left before the last bucket was packed and hashed"
    assert [e[2] for e in log if e[0] == "send"] == p.bucket_sizes, "one send per bucket, nothing else"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", ["stream", "packed"])
def test_round_trip_through_threads_is_bit_identical(backend, mode):
    named = model()
    p = prepare(named, BUCKET)
    assert len(p.bucket_sizes) > 3
    if mode == "stream":
        send = lambda tx: send_stream(tx, p, named)  # noqa: E731
    else:
        packed = pack_all(p, named)
        send = lambda tx: send_all(tx, packed.buffers)  # noqa: E731
    results = run_threads(new_init(backend, 2), send, collect(p.params, p.buckets))
    for got in results:
        assert not isinstance(got, BaseException), got
        assert sorted(got) == sorted(n for n, _ in named)
        for name, t in named:
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_corrupted_bucket_raises_checksum_mismatch_and_group_stays_in_step(backend):
    named = model()
    p = prepare(named, BUCKET)
    packed = pack_all(p, named)
    packed.buffers[1][5] ^= 0xFF  # corrupt after the checksum was taken
    sunk: list[list[str]] = [[], []]

    def worker(rx, rank):
        try:
            recv_buckets(rx, p.params, p.buckets, lambda n, v: sunk[rank - 1].append(n), expected=packed.checksums)
        except ChecksumMismatch as e:
            first = e
        else:
            raise AssertionError("corruption not detected")
        # The group is still usable: the next update goes through.
        got: dict[str, torch.Tensor] = {}
        sums = recv_buckets(rx, p.params, p.buckets, lambda n, v: got.__setitem__(n, v.clone()))
        return first, got, sums

    sent: list = []
    results = run_threads(
        new_init(backend, 2), lambda tx: (send_all(tx, packed.buffers), sent.append(send_stream(tx, p, named))), worker
    )
    for rank, res in enumerate(results):
        assert not isinstance(res, BaseException), res
        err, got, sums = res
        assert err.bucket == 1 and err.others == () and err.expected == packed.checksums[1] and err.got != err.expected
        assert sorted(sunk[rank]) == sorted(n for n, _ in named), "every bucket was received (provisionally)"
        assert all(torch.equal(got[n], t) for n, t in named)
        assert sums == sent[0] == packed.checksums, "the clean stream hashes to what the trainer hashed"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_open_raises_transfer_timeout_when_a_worker_never_joins(backend):
    init = new_init(backend, 2, timeout_s=2.0)
    tx = trainer_transfer(backend)
    bound = tx.bind(init)
    joined: list = []

    def one_worker() -> None:  # only one of the two workers shows up
        rx = worker_transfer(backend)
        try:
            rx.join(bound, 1)
        except TransferError as e:
            joined.append(e)
        finally:
            rx.close()

    t = threading.Thread(target=one_worker, daemon=True)
    t.start()
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        tx.open(bound)
    # bounded by the group timeout, not by waiting forever; the slack absorbs a loaded 2-core CI box
    assert time.monotonic() - start < init.timeout_s + 6.0
    tx.close()
    t.join(10)
    assert not t.is_alive()
    assert joined and isinstance(joined[0], TransferError)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_group_can_be_closed_and_a_new_one_opened_in_the_same_process(backend):
    named = model(1)
    p = prepare(named, BUCKET)
    packed = pack_all(p, named)
    for _ in range(2):  # same group name twice: nothing of the first group lingers
        init = new_init(backend, 1, group=f"reopen-{backend}-{os.getpid()}")
        results = run_threads(init, lambda tx: send_all(tx, packed.buffers), collect(p.params, p.buckets), workers=1)
        assert not isinstance(results[0], BaseException), results[0]
        assert all(torch.equal(results[0][n], t) for n, t in named)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_later_bucket_bigger_than_any_before_goes_through(backend):
    small = [("a", torch.arange(10, dtype=torch.float32))]
    big = [("b", torch.arange(5000, dtype=torch.float32))]
    ps, pb = prepare(small, BUCKET), prepare(big, 1 << 20)

    def worker(rx, rank):
        got: dict[str, torch.Tensor] = {}
        recv_buckets(rx, ps.params, ps.buckets, lambda n, v: got.__setitem__(n, v.clone()))
        recv_buckets(rx, pb.params, pb.buckets, lambda n, v: got.__setitem__(n, v.clone()))
        return got

    results = run_threads(
        new_init(backend, 2), lambda tx: (send_stream(tx, ps, small), send_stream(tx, pb, big)), worker
    )
    for got in results:
        assert not isinstance(got, BaseException), got
        assert torch.equal(got["a"], small[0][1]) and torch.equal(got["b"], big[0][1])


# --- separate processes -------------------------------------------------------------

WORKER = r"""
import json, sys, msgspec, torch
from rlbus.schemas import BucketMeta, ParamMeta, TransferInit
from rlbus.transfer import TransferError, recv_buckets, worker_transfer, checksum
from rlbus.transfer.buckets import as_bytes
args = json.loads(sys.argv[1])
init = msgspec.json.decode(args["init"].encode(), type=TransferInit)
params = msgspec.json.decode(args["params"].encode(), type=list[ParamMeta])
buckets = msgspec.json.decode(args["buckets"].encode(), type=list[BucketMeta])
rx = worker_transfer(init.backend)
rx.join(init, args["rank"])
out = {}
devices = set()
def sink(n, v):
    devices.add(v.device.type)  # where the stream handed the bytes over
    out[n] = f"{v.dtype}|{list(v.shape)}|{checksum(as_bytes(v.cpu()).clone(), 'xxh3')}"
try:
    recv_buckets(rx, params, buckets, sink)
except TransferError as e:
    out = {"error": type(e).__name__, "message": str(e)}
rx.close()
print(json.dumps({"tensors": out, "devices": sorted(devices)}), flush=True)
"""

TRAINER = r"""
import json, sys, msgspec, torch
from rlbus.schemas import TransferInit
from rlbus.transfer import trainer_transfer
init = msgspec.json.decode(sys.argv[1].encode(), type=TransferInit)
tx = trainer_transfer(init.backend)
bound = tx.bind(init)
print(msgspec.json.encode(bound).decode(), flush=True)
tx.open(bound)
print("open", flush=True)
sys.stdin.read()  # stay alive, sending nothing, until killed
"""


def spawn(code: str, arg: str, extra_env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(extra_env or {}))
    return subprocess.Popen(
        [sys.executable, "-c", code, arg], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_workers_in_separate_processes_receive_identical_tensors(backend):
    named = model(2)
    p = prepare(named, BUCKET)
    tx = trainer_transfer(backend)
    bound = tx.bind(new_init(backend, 2, timeout_s=30.0))
    procs = [
        spawn(
            WORKER,
            json.dumps(
                {
                    "init": msgspec.json.encode(bound).decode(),
                    "rank": r,
                    "params": msgspec.json.encode(p.params).decode(),
                    "buckets": msgspec.json.encode(p.buckets).decode(),
                }
            ),
        )
        for r in (1, 2)
    ]
    try:
        tx.open(bound)
        send_stream(tx, p, named)
        outs = [proc.communicate(timeout=30) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        tx.close()
    want = digests(named)
    for proc, (stdout, stderr) in zip(procs, outs):
        assert proc.returncode == 0, stderr
        assert "leaked" not in stderr and "resource_tracker" not in stderr, stderr
        assert json.loads(stdout.strip().splitlines()[-1]) == {"tensors": want, "devices": ["cpu"]}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_receiver_whose_sender_dies_gets_an_error_instead_of_hanging(backend):
    init = new_init(backend, 1, timeout_s=3.0)
    trainer = spawn(TRAINER, msgspec.json.encode(init).decode(), stdin=subprocess.PIPE)
    try:
        assert trainer.stdout is not None
        bound = msgspec.json.decode(trainer.stdout.readline().encode(), type=TransferInit)
        rx = worker_transfer(backend)
        rx.join(bound, 1)
        assert trainer.stdout.readline().strip() == "open"
        handle = rx.recv(torch.empty(1024, dtype=torch.uint8))
        trainer.kill()
        trainer.wait(10)
        start = time.monotonic()
        with pytest.raises(TransferError):
            handle.wait()
        assert time.monotonic() - start < init.timeout_s + 2
        rx.close()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.communicate(timeout=10)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="nccl needs two CUDA devices (two ranks cannot share one GPU)",
)
def test_nccl_round_trip_between_two_processes_is_bit_identical_and_stays_on_the_gpus():
    """GPU tensors are packed, hashed (the device checksum) and sent on cuda:0; the worker
    receives, hashes and hands over views on its GPU."""
    named = [(n, t.to("cuda:0")) for n, t in model(3)]
    p = prepare(named, BUCKET)
    tx = trainer_transfer("nccl")
    bound = tx.bind(new_init("nccl", 1, timeout_s=60.0))
    proc = spawn(
        WORKER,
        json.dumps(
            {
                "init": msgspec.json.encode(bound).decode(),
                "rank": 1,
                "params": msgspec.json.encode(p.params).decode(),
                "buckets": msgspec.json.encode(p.buckets).decode(),
            }
        ),
        extra_env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    try:
        torch.cuda.set_device(0)
        tx.open(bound)
        assert tx.checksum_kind == "device"  # type: ignore[attr-defined]
        send_stream(tx, p, named)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        tx.close()
    assert proc.returncode == 0, stderr
    want = {n: f"{t.dtype}|{list(t.shape)}|{checksum(as_bytes(t.cpu()).clone(), 'xxh3')}" for n, t in named}
    assert json.loads(stdout.strip().splitlines()[-1]) == {"tensors": want, "devices": ["cuda"]}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_with_the_device_checksum_forced_both_ends_hash_alike_and_catch_a_bad_or_missing_bucket(backend, monkeypatch):
    """What NCCL uses, run on CPU over gloo and shm: the trainer's and every worker's checksums
    are the device checksum of each bucket seeded with its place, a flipped bit and a missing
    bucket are refused, and the group stays usable."""
    from rlbus.transfer.checksum import device_checksum
    from rlbus.transfer.stream import verify

    monkeypatch.setenv("RLBUS_CHECKSUM", "device")
    named = model()
    p = prepare(named, BUCKET)
    packed = pack_all(p, named, kind="device")
    want = [device_checksum(b, k) for k, b in enumerate(packed.buffers)]
    assert packed.checksums == want and want != [checksum(b, "xxh3") for b in packed.buffers]
    sent: list = []

    def worker(rx, rank):
        got: dict[str, torch.Tensor] = {}
        sums = recv_buckets(rx, p.params, p.buckets, lambda n, v: got.__setitem__(n, v.clone()))
        with pytest.raises(ChecksumMismatch):
            recv_buckets(rx, p.params, p.buckets, lambda n, v: None, expected=want)
        with pytest.raises(ChecksumMismatch, match="checksum count"):
            verify(sums[:-1], want)
        return got, sums

    def trainer(tx):
        sent.append(send_stream(tx, p, named))
        packed.buffers[2][0] ^= 0x01  # after its checksum was taken
        send_all(tx, packed.buffers)

    for res in run_threads(new_init(backend, 2), trainer, worker):
        assert not isinstance(res, BaseException), res
        got, sums = res
        assert sums == sent[0] == want
        assert all(torch.equal(got[n], t) for n, t in named)
