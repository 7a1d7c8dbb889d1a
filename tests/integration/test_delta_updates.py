"""Delta weight updates on an in-process fleet serving bfloat16: the trainer keeps float32
master weights, trains them with Adam, and pushes only the bf16 elements that changed.

One fleet per (transport, update mode, data-plane path): gloo + staged on the device path run on
CPU (RLBUS_CHECKSUM=device, RLBUS_DELTA=device: the checksum, compare, encode and apply GPU
tensors take over NCCL) and shm + in_place on the host path (xxh3, numpy's compare), each with a
draft, started once; tests that break the fleet's membership start a small fleet of their own.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

import rlbus
from rlbus.models.tinylm import ModelConfig, TinyLM
from rlbus.transfer.buckets import as_bytes
from rlbus.transfer.checksum import checksum
from tests.fleet import fleet_running, nccl_worker, start_fleet
from tests.waiting import eventually
from tests.weights_helpers import new_version, settled  # noqa: F401 - the autouse fixture around every test

BF16 = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, seed=0, dtype="bfloat16")
DRAFT = msgspec.structs.replace(BF16, n_layers=1, seed=1000)
CONFIGS = [("gloo", "staged", "device"), ("shm", "in_place", "host")]


class Master:
    """A trainer's float32 master copy of a bf16-served model, stepped with Adam."""

    def __init__(self, cfg: ModelConfig, lr: float, seed: int = 0) -> None:
        self.model = TinyLM(msgspec.structs.replace(cfg, dtype="float32"))  # same init as the workers, before rounding
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            tokens = torch.randint(0, self.model.cfg.vocab_size, (12,), generator=self.gen)
            target = torch.randint(0, self.model.cfg.vocab_size, (12,), generator=self.gen)
            self.opt.zero_grad()
            torch.nn.functional.cross_entropy(self.model(tokens), target).backward()
            self.opt.step()

    def served(self) -> list[tuple[str, torch.Tensor]]:
        """What the workers serve: the master weights rounded to bfloat16."""
        return [(n, p.detach().to(torch.bfloat16)) for n, p in self.model.named_parameters()]


def sums(named) -> dict[str, str]:
    return {n: checksum(as_bytes(t)) for n, t in dict(named).items()}


def assert_fleet_holds(fleet, named, target: str = "main") -> None:
    """Every worker's full tensors hash to the trainer's (the checksums of full tensors)."""
    want = sums(named)
    for wid, w in fleet.workers.items():
        part = w.engine.main if target == "main" else w.engine.draft
        have = sums(part.model.named_parameters())
        assert have == want, f"{wid}: {[n for n in want if have.get(n) != want[n]]} differ"
        assert not w.book.dirty


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: "-".join(c))
def config(request) -> tuple[str, str, str]:
    return request.param


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix, config):
    backend, mode, path = config
    env = pytest.MonkeyPatch()
    if path == "device":  # both ends of every group, every whole-tensor check, every compare and write
        env.setenv("RLBUS_CHECKSUM", "device")
        env.setenv("RLBUS_DELTA", "device")
    # a generous liveness timeout: a worker dropped and withheld on a loaded box would (rightly) refuse a delta
    async with fleet_running(
        nats_server.url,
        prefix + backend,
        model=BF16,
        engine_kw={"draft_config": DRAFT},
        liveness_timeout_s=5.0,
        weight_transfer_backend=backend,
        update_mode=mode,
    ) as running:
        yield running
    env.undo()


@pytest.fixture(scope="module")
def master() -> Master:
    """One master per module: each test continues the training (so every fleet keeps a base)."""
    return Master(BF16, lr=2e-5)


async def _push(rl, master: Master, **kw):
    named = master.served()
    await rl.push_weights(named, new_version("delta"), delta=True, **kw)
    return named, rl.last_push


async def test_twenty_delta_pushes_of_an_adam_trained_model_end_bit_identical_on_every_worker(fleet, master):
    f, rl = fleet
    master.step()
    named, first = await _push(rl, master)
    assert first.committed
    deltas = pushed_as_delta = 0
    for _ in range(20):
        master.step()
        named, st = await _push(rl, master)
        assert st.committed, st
        assert_fleet_holds(f, named)
        if not st.delta:  # a worker the controller dropped and withheld (a stalled loop) refuses: dense, and consistent
            assert st.fallback is not None, st
            continue
        pushed_as_delta += 1
        assert st.tensors == len(named) and st.compared == st.elements
        assert st.bytes_sent < st.bytes_dense
        assert 0 < st.changed < st.elements
        deltas += st.tensors_delta
    assert pushed_as_delta >= 18 and deltas > 0
    # a dense push of the same weights leaves every worker exactly where the deltas did
    await rl.push_weights(named, new_version("dense"))
    assert_fleet_holds(f, named)


async def test_a_delta_compared_in_groups_each_while_the_last_travels_ends_bit_identical(fleet, master, monkeypatch):
    """The next group of tensors is compared while the last one's metadata and buckets travel:
    four updates, started in order, each compare overlapping the previous send."""
    from rlbus.sdk import push as P

    f, rl = fleet
    await _push(rl, master)
    monkeypatch.setattr(P, "DELTA_GROUP_MIN_BYTES", 1)
    monkeypatch.setattr(P, "DELTA_GROUPS", 4)  # as many as this small model's tensors make even
    log: list[str] = []
    encode, send = rl.push._encode, rl.push._send

    def logged_encode(group):
        log.append("encode+")
        try:
            return encode(group)
        finally:
            log.append("encode-")

    async def logged_send(*args):
        log.append("send+")
        try:
            return await send(*args)
        finally:
            log.append("send-")

    monkeypatch.setattr(rl.push, "_encode", logged_encode)
    monkeypatch.setattr(rl.push, "_send", logged_send)
    master.step()
    named, st = await _push(rl, master)
    assert st.committed and st.delta and st.tensors == len(named) and st.compared == st.elements
    assert_fleet_holds(f, named)
    assert log.count("encode+") == log.count("send+") == P.DELTA_GROUPS
    assert log[:3] == ["encode+", "encode-", "send+"] and log.index("encode+", 1) < log.index("send-"), log


async def test_the_compares_of_every_group_and_every_push_run_on_the_same_kept_threads(fleet, master, monkeypatch):
    """The compare threads are started once and kept: every group of a push, and the next push,
    compares on them (threads started afresh per group cost the encode ~6 %)."""
    import threading

    from rlbus.sdk import push as P
    from rlbus.transfer import delta as D

    f, rl = fleet
    await _push(rl, master)
    monkeypatch.setattr(P, "DELTA_GROUP_MIN_BYTES", 1)
    monkeypatch.setattr(P, "DELTA_GROUPS", 4)
    monkeypatch.setattr(rl.push, "encode_threads", 2)
    ran_on: list[set[int]] = []
    diff_many = D.diff_many

    def recorded(*args, **kw):
        ran_on[-1].add(threading.get_native_id())
        return diff_many(*args, **kw)

    monkeypatch.setattr(D, "diff_many", recorded)
    for _ in range(2):
        ran_on.append(set())
        master.step()
        named, st = await _push(rl, master)
        assert st.committed and st.delta and st.compared == st.elements
        assert_fleet_holds(f, named)
    assert 1 <= len(ran_on[0] | ran_on[1]) <= 2, ran_on  # two threads for eight groups in all
    assert threading.get_native_id() not in ran_on[0] | ran_on[1]
    kept = [t for t in threading.enumerate() if t.native_id in ran_on[0] | ran_on[1]]
    assert kept and all(t.is_alive() for t in kept)
    rl.push.end_compares()  # what the client's close does: the threads end
    for t in kept:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in kept)
    ran_on.append(set())
    master.step()
    named, st = await _push(rl, master)  # a later push starts new ones
    assert st.committed and st.delta and ran_on[-1] and not ran_on[-1] & (ran_on[0] | ran_on[1])
    assert_fleet_holds(f, named)


async def test_the_explicit_lifecycle_sends_deltas_in_two_updates(fleet, master):
    f, rl = fleet
    await _push(rl, master)
    master.step(2)
    named = master.served()
    await rl.pause("wait")
    await rl.start_weight_update(delta=True)
    await rl.update_weights(named[:5])
    await rl.update_weights(named[5:])
    await rl.finish_weight_update(new_version("explicit"))
    await rl.resume()
    assert rl.last_push.delta and rl.last_push.committed and rl.last_push.tensors == len(named)
    assert_fleet_holds(f, named)


async def test_a_tensor_that_changed_entirely_goes_dense(fleet, master):
    f, rl = fleet
    await _push(rl, master)
    with torch.no_grad():
        master.model.lm_head.weight.add_(1.0)
    named, st = await _push(rl, master)
    assert st.delta and st.tensors_dense == 1
    assert st.tensors_delta + st.tensors_unchanged == st.tensors - 1
    assert_fleet_holds(f, named)


async def test_a_worker_on_another_base_refuses_and_the_push_falls_back_to_dense(fleet, master):
    f, rl = fleet
    await _push(rl, master)
    w1 = f.workers["w1"].book
    w1.relabel(w1.main.version, w1.main.seq + 7)  # holds another commit than the trainer's base
    master.step()
    named, st = await _push(rl, master)
    assert not st.delta and st.committed and st.fallback is not None
    assert "w1" in st.fallback and "w0" not in st.fallback.split("failed on")[-1].split("w1")[0]
    assert st.tensors_dense == st.tensors and st.bytes_sent >= st.bytes_dense
    assert_fleet_holds(f, named)
    seqs = {w.book.main.seq for w in f.workers.values()}
    assert len(seqs) == 1
    master.step()
    named, st = await _push(rl, master)  # consistent again: deltas resume
    assert st.delta
    assert_fleet_holds(f, named)


async def test_a_repair_between_a_pushs_pause_and_its_start_leaves_the_push_to_rebuild_its_group(
    fleet, master, monkeypatch
):
    """The controller repairs a worker that holds other bits than the commit; its receivers leave
    the repair group with none, so a push whose start comes after such a repair finds them out of
    the group it built (a CI run: FAILED_PRECONDITION "left transfer group" on the dense start
    after the delta's refusal). The push rebuilds the group and commits."""
    f, rl = fleet
    await _push(rl, master)
    w1 = f.workers["w1"]
    committed = w1.book.main.seq
    start = rl.push.start

    async def after_a_repair(*a, **k):
        monkeypatch.setattr(rl.push, "start", start)
        w1.book.relabel(w1.book.main.version, committed + 7)  # paused: the repair runs at its next report
        await eventually(lambda: w1.book.main.seq == committed, timeout=30, what="w1 repaired")
        return await start(*a, **k)

    monkeypatch.setattr(rl.push, "start", after_a_repair)
    master.step()
    named, st = await _push(rl, master)
    assert st.committed
    assert_fleet_holds(f, named)


async def test_a_delta_refusal_names_the_worker_with_failed_precondition(fleet, master):
    f, rl = fleet
    await _push(rl, master)
    w0 = f.workers["w0"].book
    w0.relabel(w0.main.version, w0.main.seq + 3)
    try:
        await rl.pause("wait")
        with pytest.raises(rlbus.FailedPrecondition) as err:
            # the raw command, as any client sends it: the SDK would fall back
            await rl.call(
                rlbus.schemas.StartWeightUpdate(base_seq=rl.push.committed["main"].seq), rlbus.schemas.FleetAck
            )
        assert err.value.workers == ["w0"] and "w0" in err.value.failures[0].message
        assert (await rl.server_info()).session_id is None
        assert all(w.updates.session is None for w in f.workers.values())
    finally:
        w0.relabel(w0.main.version, w0.main.seq - 3)
        await rl.resume()


async def test_a_result_that_is_not_the_trainers_aborts_everywhere_then_heals(fleet, master, config):
    f, rl = fleet
    await _push(rl, master)
    before = {w: sums(x.engine.main.model.named_parameters()) for w, x in f.workers.items()}
    version = (await rl.server_info()).weight_version
    master.step()
    with torch.no_grad():
        w = master.model.blocks[0].fc1.weight.view(-1)
        w[5] += 1.5
        # the trainer's idea of the base is off by one element: it believes the workers hold the new value
        rl.push.settle()  # the last commit's deltas written onto it first
        rl.push.committed["main"].tensors["blocks.0.fc1.weight"].view(-1)[5] = w[5].to(torch.bfloat16)
    with pytest.raises(rlbus.Aborted) as err:
        await _push(rl, master)
    assert sorted(err.value.workers) == ["w0", "w1"] and "bit-identical" in err.value.message
    assert (await rl.server_info()).weight_version == version
    if config[1] == "staged":  # nothing changed
        for w, x in f.workers.items():
            assert sums(x.engine.main.model.named_parameters()) == before[w]
    named, st = await _push(rl, master)  # the snapshot was dropped: dense, and consistent
    assert not st.delta and st.committed
    assert_fleet_holds(f, named)


async def test_a_delta_corrupted_on_the_wire_aborts_everywhere(fleet, master):
    f, rl = fleet
    await _push(rl, master)
    version = (await rl.server_info()).weight_version
    tx = rl.push.transfer
    send, flipped = tx.send, []

    def flip_first(buf):
        if not flipped:
            buf[-1] ^= 0x01
            flipped.append(True)
        return send(buf)

    tx.send = flip_first
    try:
        master.step()
        with pytest.raises(rlbus.Aborted) as err:
            await _push(rl, master)
    finally:
        tx.send = send
    assert flipped and sorted(err.value.workers) == ["w0", "w1"] and "checksum" in err.value.message
    assert (await rl.server_info()).weight_version == version
    named, _ = await _push(rl, master)
    assert_fleet_holds(f, named)


async def test_an_aborted_delta_leaves_the_next_delta_correct(fleet, master, config):
    f, rl = fleet
    await _push(rl, master)
    master.step()
    await rl.pause("wait")
    await rl.start_weight_update(delta=True)
    await rl.update_weights(master.served())
    await rl.abort_weight_update("changed my mind")
    await rl.resume() if config[1] == "staged" else None
    master.step()
    named, st = await _push(rl, master)
    # staged: the base is intact, the next push is a delta; in place: the abort left the
    # workers dirty, they refuse the delta and the push goes dense
    assert st.delta == (config[1] == "staged") and st.committed
    assert_fleet_holds(f, named)


async def test_draft_deltas_work(fleet):
    f, rl = fleet
    draft = Master(DRAFT, lr=2e-5, seed=5)
    for k in range(4):
        draft.step()
        named = draft.served()
        await rl.push_weights(named, f"draft-{new_version()}", draft=True, delta=True)
        st = rl.last_push
        assert st.target == "draft" and st.delta == (k > 0) and st.committed
        assert_fleet_holds(f, named, target="draft")
    seqs = {w.book.draft.seq for w in f.workers.values()}
    assert len(seqs) == 1 and seqs.pop() == (await rl.get_weight_version_info()).draft_seq


async def test_a_late_joiner_is_repaired_onto_the_base_and_the_next_delta_reaches_the_whole_fleet(nats_server, prefix):
    from rlbus.services.worker.reference_engine import ReferenceEngine
    from rlbus.services.worker.service import WorkerOptions

    f, rl = await start_fleet(nats_server.url, prefix + "late", ["w0"], model=BF16, weight_transfer_backend="gloo")
    try:
        m = Master(BF16, lr=2e-5, seed=9)
        for _ in range(2):
            m.step()
            named, _ = await _push(rl, m)
        assert rl.last_push.delta
        late = await f.start_worker(
            ReferenceEngine(BF16),
            WorkerOptions(worker_id="w9", subjects=rl.subjects, weight_transfer_backend="gloo", heartbeat_s=0.25),
        )
        await f.wait_for_workers(["w0", "w9"])
        committed = f.controller.version
        # a healthy peer (w0) repairs it onto exactly the committed bits: the delta's base
        await eventually(
            lambda: late.state().weight_seq == committed.seq and not late.state().withheld,
            timeout=30,
            what="w9 repaired",
        )
        assert_fleet_holds(f, named)
        m.step()
        named, st = await _push(rl, m)
        assert st.delta and st.fallback is None, st
        assert_fleet_holds(f, named)
        m.step()
        named, st = await _push(rl, m)
        assert st.delta
        assert_fleet_holds(f, named)
    finally:
        await rl.close()
        await f.close()


@pytest.mark.gpu
async def test_delta_pushes_over_nccl_are_verified_by_every_worker(nats_server, prefix):
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl needs the trainer and the worker on different GPUs")
    p = prefix + "nccl"
    f, rl = await start_fleet(nats_server.url, p, [], model=BF16)
    try:
        with nccl_worker(nats_server.url, p, "gpu0", BF16, "--dtype", "bfloat16"):
            with anyio.fail_after(90):
                await f.wait_for_workers(["gpu0"])
            torch.cuda.set_device(0)
            await rl.init_weight_transfer("nccl", timeout_s=60)
            m = Master(BF16, lr=2e-5, seed=3)
            for k in range(3):
                m.step()
                named = [(n, t.to("cuda:0")) for n, t in m.served()]
                await rl.push_weights(named, new_version("nccl-delta"), delta=True)
                # a committed delta is one every worker hashed bit-identical to the trainer's result
                assert rl.last_push.committed and rl.last_push.delta == (k > 0)
    finally:
        await rl.close()
        await f.close()
