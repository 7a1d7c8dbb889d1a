"""An abort, a sleep or a stop while a gloo receive waits for bytes that never come returns at
once and never stalls the worker's event loop: heartbeats, generation and the next push go on.

The services share the test's event loop, so a worker blocked in a group teardown blocks the
loop-lag guard too. Every group here has a 30 s collective timeout, so a teardown that joins
the pending receive shows as a 30 s stall. Below those: a transport's close with a transfer
in flight (gloo and shm, either side) and SIGTERM to a worker process, both prompt.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import anyio
import msgspec
import pytest
from rlbus.schemas import FleetAck, TransferInit, UpdateWeights

from rlbus.transfer.stream import prepare
from tests.fleet import fleet_running
from tests.looplag import LoopLag
from tests.waiting import eventually
from tests.weights_helpers import MODEL, assert_holds, new_version, trained

TIMEOUT_S = 30.0
"""The groups' collective timeout: long, so that waiting it out cannot pass for prompt."""
PROMPT_S = 2.0
LAG_S = 0.3


def _receiving_threads() -> int:
    """Threads waiting inside a torch.distributed collective (``_WorkHandle.wait``)."""
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("torchdist.py"):
                count += 1
                break
            frame = frame.f_back
    return count


async def _metadata_only(fleet, rl) -> None:
    """Open a session and send the metadata but not the bytes: every worker starts a receive
    that waits for the trainer's broadcast."""
    await rl.init_weight_transfer(timeout_s=TIMEOUT_S)
    await rl.start_weight_update()
    plan = prepare(trained(7), 4096)
    waiting = _receiving_threads()
    await rl.call(UpdateWeights(params=plan.params, buckets=plan.buckets), FleetAck)
    await eventually(
        lambda: all(w.updates.session is not None and w.updates.session.receiving for w in fleet.workers.values()),
        what="every worker receiving",
    )
    await eventually(
        lambda: _receiving_threads() >= waiting + len(fleet.workers), what="every worker's receive waiting in gloo"
    )


async def _still_serving(fleet, rl, lag: LoopLag, ids: list[str]) -> None:
    """Heartbeats keep every worker registered past the liveness timeout, generation answers
    promptly, and a new push (a new group) commits everywhere."""
    assert fleet.controller is not None
    await anyio.sleep(2.0)  # > liveness_timeout_s (1.5): a silent worker would have left
    assert all(w in fleet.controller.registry for w in ids), "a worker stopped heartbeating"
    t0 = time.perf_counter()
    reply = await rl.generate([1, 2, 3], 4, timeout=PROMPT_S)
    assert len(reply.tokens) == 4 and time.perf_counter() - t0 < PROMPT_S
    lag.check("while aborting and serving")
    named = trained(11)
    version = new_version("after-abort")
    ack = await rl.push_weights(named, version)
    assert ack.weight_version == version and sorted(w.worker_id for w in ack.workers) == sorted(ids)
    for wid in ids:
        assert_holds(fleet, wid, named)


async def test_an_abort_during_a_pending_receive_returns_at_once_and_the_fleet_keeps_serving(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix + "-abort", weight_transfer_backend="gloo", model=MODEL) as (
        f,
        rl,
    ):
        await _metadata_only(f, rl)
        async with LoopLag(LAG_S) as lag:
            t0 = time.perf_counter()
            with anyio.fail_after(3 * PROMPT_S):
                aborted = await rl.abort_weight_update("trainer changed its mind")
            took = time.perf_counter() - t0
            assert took < PROMPT_S, f"abort took {took:.1f}s"
            assert all(w.session_id is None for w in aborted.workers)
            await _still_serving(f, rl, lag, ["w0", "w1"])


async def test_sleep_during_a_pending_receive_returns_at_once(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix + "-sleep", weight_transfer_backend="gloo", model=MODEL) as (
        f,
        rl,
    ):
        await _metadata_only(f, rl)
        async with LoopLag(LAG_S) as lag:
            t0 = time.perf_counter()
            with anyio.fail_after(3 * PROMPT_S):
                slept = await rl.sleep(level=1)
            took = time.perf_counter() - t0
            assert took < PROMPT_S, f"sleep took {took:.1f}s"
            assert all(w.session_id is None for w in slept.workers)
            await rl.wake_up()
            await _still_serving(f, rl, lag, ["w0", "w1"])


async def test_stopping_a_worker_during_a_pending_receive_returns_at_once(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix + "-stop", weight_transfer_backend="gloo", model=MODEL) as (f, rl):
        await _metadata_only(f, rl)
        async with LoopLag(LAG_S) as lag:
            t0 = time.perf_counter()
            with anyio.fail_after(3 * PROMPT_S):
                await f.stop(f.workers["w0"])
            took = time.perf_counter() - t0
            assert took < PROMPT_S, f"stopping a worker took {took:.1f}s"
            # the controller aborts the session when w0 says goodbye
            await eventually(
                lambda: f.workers["w1"].updates.session is None, timeout=PROMPT_S, what="w1's session aborted"
            )
            await _still_serving(f, rl, lag, ["w1"])


_PENDING = """
import sys, threading, time
import msgspec, torch
from rlbus.schemas import TransferInit
from rlbus.transfer.factory import trainer_transfer, worker_transfer

backend, side = sys.argv[1], sys.argv[2]
init = TransferInit(backend=backend, master_addr="127.0.0.1", master_port=0, world_size=2,
                    rank_offset=1, group_name="pending", timeout_s=float(sys.argv[3]))
if side == "worker":  # a receive waits for bytes the trainer never sends
    rx = worker_transfer(backend)
    rx.join(msgspec.json.decode(sys.stdin.readline(), type=TransferInit), 1)
    handle, closing = rx.recv(torch.empty(1024, dtype=torch.uint8)), rx
    pending = handle.wait
else:                 # sends wait for a worker that never receives
    tx = trainer_transfer(backend)
    print(msgspec.json.encode(tx.bind(init)).decode(), flush=True)
    tx.open(init)
    buf, closing = torch.zeros(64 << 20, dtype=torch.uint8), tx
    pending = lambda: [tx.send(buf).wait() for _ in range(3)]
threading.Thread(target=pending, daemon=True).start()
time.sleep(0.3)
t0 = time.perf_counter()
closing.close()
print("closed in", round(time.perf_counter() - t0, 3), flush=True)
"""


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("side", ["worker", "trainer"])
def test_closing_a_group_with_a_pending_transfer_returns_at_once_and_the_process_exits(backend, side):
    """A process closes its side of a group while a transfer in it waits for the peer (alive
    in this process, never sending or receiving): close returns at once, and the process
    exits without waiting for the collective timeout."""
    from rlbus.transfer.factory import trainer_transfer, worker_transfer

    proc = subprocess.Popen(
        [sys.executable, "-c", _PENDING, backend, side, str(TIMEOUT_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peer = trainer_transfer(backend) if side == "worker" else worker_transfer(backend)
    try:
        if side == "worker":
            init = peer.bind(
                TransferInit(
                    backend=backend,
                    master_addr="127.0.0.1",
                    master_port=0,
                    world_size=2,
                    rank_offset=1,
                    group_name="pending",
                    timeout_s=TIMEOUT_S,
                )
            )
            opening = threading.Thread(target=peer.open, args=(init,), daemon=True)
            opening.start()
            proc.stdin.write(msgspec.json.encode(init).decode() + "\n")
            proc.stdin.flush()
        else:
            init = msgspec.json.decode(proc.stdout.readline(), type=TransferInit)
            opening = threading.Thread(target=peer.join, args=(init, 1), daemon=True)
            opening.start()
        t0 = time.perf_counter()
        out, err = proc.communicate(timeout=TIMEOUT_S + 30)
        took = time.perf_counter() - t0
        assert proc.returncode == 0, err
        assert "closed in" in out, err
        assert float(out.split("closed in")[1]) < 0.5, out
        assert took < TIMEOUT_S / 2, f"the process took {took:.1f}s to exit"
    finally:
        proc.kill()
        proc.wait()
        peer.close()


def test_closing_twice_and_closing_an_unopened_group_are_harmless():
    from rlbus.transfer.shm import ShmTrainer, ShmWorker
    from rlbus.transfer.torchdist import TorchDistTrainer, TorchDistWorker

    for group in (TorchDistTrainer("gloo"), TorchDistWorker("gloo"), ShmTrainer(), ShmWorker()):
        group.close()
        group.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("rlbus-close")]


async def test_sigterm_during_a_pending_receive_stops_a_worker_process_at_once(nats_server, prefix):
    """The process view of the stop above: nothing (no pool thread stuck in the receive, no
    group teardown) keeps a worker process from exiting before the collective timeout."""
    import signal

    from rlbus.runners.launcher import ProcessFleet
    from rlbus.sdk.client import RLClient

    p = prefix + "-proc"
    flags = [
        "--vocab-size",
        str(MODEL.vocab_size),
        "--d-model",
        str(MODEL.d_model),
        "--n-layers",
        str(MODEL.n_layers),
        "--n-heads",
        str(MODEL.n_heads),
        "--max-seq-len",
        str(MODEL.max_seq_len),
        "--seed",
        str(MODEL.seed),
    ]
    procs = ProcessFleet(
        nats_server.url,
        1,
        ["--weight-transfer-backend", "gloo", "--prefix", p, "--heartbeat", "0.25", *flags],
        ["--prefix", p, "--liveness-timeout", "1.5", "--command-timeout", "10"],
    )
    procs.start()
    rl = await RLClient.connect(nats_server.url, prefix=p, timeout=30.0)
    try:

        async def registered() -> bool:
            procs.check_alive()
            try:
                return [w.worker_id for w in (await rl.server_info()).workers] == ["worker-0"]
            except Exception:
                return False

        await eventually(registered, timeout=90, interval=0.1, what="the worker process registered")
        await rl.init_weight_transfer(timeout_s=TIMEOUT_S)
        await rl.start_weight_update()
        plan = prepare(trained(7), 4096)
        await rl.call(UpdateWeights(params=plan.params, buckets=plan.buckets), FleetAck)
        await anyio.sleep(0.5)  # the acked receive is waiting in gloo by now
        worker = procs.procs["worker-0"]
        t0 = time.perf_counter()
        worker.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(worker.wait, TIMEOUT_S + 10)
        took = time.perf_counter() - t0
        assert code == 0, f"the worker exited with {code}"
        assert took < 5, f"the worker took {took:.1f}s to stop after SIGTERM"
    finally:
        await rl.close()
        procs.stop()


def test_a_process_whose_receive_wakes_as_it_exits_ends_with_its_own_status():
    """A stopped worker's receive wakes with an error (its group or its trainer closed) while
    the process exits. Had Python begun to finalize, it would end that thread with
    pthread_exit through torch's C++ and abort the process (SIGABRT: 1 in 30 SIGTERMs to a
    worker process mid-push; every run of tests/exiting_receiver.py that returns, without
    rlbus's exit handler). A process that returns waits for the receive at exit; a worker
    process ends through run_then_exit."""
    runs = {
        (ending, code): subprocess.Popen(
            [sys.executable, "-m", "tests.exiting_receiver", ending, str(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ending, code in (("return", 3), ("run_then_exit", 2))
    }
    for (ending, code), proc in runs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == code, f"{ending}: exited with {proc.returncode}, not {code}: {err[-2000:]}"
        assert "terminate called" not in err, err
