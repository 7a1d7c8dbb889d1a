"""Weight updates to workers that are separate processes (rlbus.runners.launcher.ProcessFleet), over gloo.

Workers are remote here, so bit-level evidence comes from greedy decoding: every worker's
output must equal a local TinyLM's holding the pushed tensors, token for token. One ProcessFleet
per module (each process imports torch); the worker-killing test runs last.
"""

from __future__ import annotations

import time

import anyio
import pytest

import rlbus
from rlbus.runners.launcher import ProcessFleet
from rlbus.sdk.client import RLClient
from tests.waiting import eventually
from tests.weights_helpers import MAX_TOKENS, MODEL, PROMPTS, first_watched_version, greedy, new_version, trained

WORKERS = ["worker-0", "worker-1"]
MODEL_FLAGS = [
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
FINISH_BOUND_S = 15.0


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    procs = ProcessFleet(
        nats_server.url,
        2,
        ["--weight-transfer-backend", "gloo", "--prefix", prefix, "--heartbeat", "0.25", *MODEL_FLAGS],
        ["--prefix", prefix, "--liveness-timeout", "1.5", "--command-timeout", "10"],
    )
    procs.start()
    rl = await RLClient.connect(nats_server.url, prefix=prefix, timeout=30.0)
    try:

        async def registered() -> bool:
            procs.check_alive()
            try:
                return sorted(w.worker_id for w in (await rl.server_info()).workers) == WORKERS
            except rlbus.RLBusError:
                return False  # the controller is still importing

        await eventually(registered, timeout=90, interval=0.1, what="both worker processes registered")
        yield procs, rl
    finally:
        await rl.close()
        procs.stop()


async def generations_by_worker(rl: RLClient, want: list[str], prompts=PROMPTS) -> dict[str, list]:
    """Generate every prompt repeatedly until each worker in `want` answered all of them
    (the queue group picks the worker)."""
    seen: dict[str, dict[int, object]] = {}

    async def covered() -> bool:
        for i, p in enumerate(prompts):
            r = await rl.generate(p, MAX_TOKENS)
            seen.setdefault(r.worker_id, {})[i] = r
        return all(len(seen.get(w, {})) == len(prompts) for w in want)

    await eventually(covered, timeout=30, interval=0, what=f"generations from {want}")
    return {w: [seen[w][i] for i in range(len(prompts))] for w in seen}


async def test_push_weights_makes_worker_processes_decode_exactly_like_the_trainers_model(fleet):
    _, rl = fleet
    initial = greedy(trained(MODEL.seed))
    named = trained(7)
    expected = greedy(named)
    assert expected != initial
    version = new_version("proc")

    ack = await rl.push_weights(named, version)

    assert sorted(w.worker_id for w in ack.workers) == WORKERS
    assert all(w.weight_version == version for w in ack.workers)
    info = await rl.server_info()
    assert info.weight_version == version and all(w.state.weight_version == version for w in info.workers)
    assert await rl.get_weight_version() == version
    by_worker = await generations_by_worker(rl, WORKERS)
    for wid in WORKERS:
        replies = by_worker[wid]
        assert [r.tokens for r in replies] == expected, f"{wid} does not hold the pushed weights bit for bit"
        assert all(r.weight_version == version for r in replies)


async def test_a_worker_killed_before_finish_fails_the_finish_and_the_fleet_recovers_without_it(fleet):
    procs, rl = fleet
    old_version = (await rl.server_info()).weight_version
    old_named = trained(7)  # what the previous test committed
    if old_version == "default":  # run alone: commit a known model first
        old_version = new_version("proc")
        await rl.push_weights(old_named, old_version)

    await rl.start_weight_update()
    await rl.update_weights(trained(8))
    procs.procs["worker-1"].kill()
    procs.procs["worker-1"].wait(10)

    started = time.monotonic()
    with pytest.raises((rlbus.Unavailable, rlbus.DeadlineExceeded, rlbus.Aborted)) as err:
        await rl.finish_weight_update(new_version("never"))
    assert time.monotonic() - started < FINISH_BOUND_S
    assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED")
    assert "worker-1" in err.value.workers

    info = await rl.server_info()
    assert info.weight_version == old_version and info.session_id is None
    assert await first_watched_version(rl) == old_version

    async def only_worker_0() -> bool:
        return [w.worker_id for w in (await rl.server_info()).workers] == ["worker-0"]

    await eventually(only_worker_0, timeout=10, interval=0.05, what="worker-1 left the registry")
    survivors = await generations_by_worker(rl, ["worker-0"])
    assert set(survivors) == {"worker-0"}
    assert [r.tokens for r in survivors["worker-0"]] == greedy(old_named)
    assert all(r.weight_version == old_version for r in survivors["worker-0"])

    with anyio.fail_after(30):
        ack = await rl.init_weight_transfer(timeout_s=10)
    assert [w.worker_id for w in ack.workers] == ["worker-0"]
    recovered, version = trained(9), new_version("proc")
    done = await rl.push_weights(recovered, version)
    assert [w.worker_id for w in done.workers] == ["worker-0"] and done.weight_version == version
    replies = (await generations_by_worker(rl, ["worker-0"]))["worker-0"]
    assert [r.tokens for r in replies] == greedy(recovered)
    assert await first_watched_version(rl) == version
