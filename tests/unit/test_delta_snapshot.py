"""The trainer's copy of the committed bits (rlbus.sdk.snapshot): it moves only at a commit,
and only along the session that was taken against it. Every test runs on the host path and on
the device path (torch ops) forced on CPU tensors."""

from __future__ import annotations

import threading

import pytest
import torch

from rlbus.sdk.snapshot import Committed, Pending
from rlbus.transfer import delta as D


@pytest.fixture(autouse=True, params=["host", "device"])
def path(request, monkeypatch) -> str:
    if request.param == "device":
        monkeypatch.setenv(D.DEVICE_ENV, "device")
    return request.param


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "b": torch.randn(256, generator=g).to(torch.bfloat16),
    }


def test_a_committed_delta_session_brings_the_snapshot_to_the_new_bits():
    base = Committed(seq=3, tensors={n: t.clone() for n, t in _tensors().items()})
    new = {n: t.clone() for n, t in base.tensors.items()}
    new["a"].view(-1)[[1, 100, 4000]] += 1
    new["b"] += 1  # all of it: sent dense
    pending = Pending(base_seq=3)
    changed, d = D.diff(new["a"], base.tensors["a"])
    assert changed == 3 and d is not None
    pending.deltas["a"] = d
    pending.dense["b"] = new["b"].clone()
    after = pending.commit(base, 4)
    assert after.seq == 4
    assert all(torch.equal(D.bits(after.tensor(n)), D.bits(new[n])) for n in new)


def test_a_dense_session_or_another_base_replaces_the_snapshot_with_what_it_sent():
    base = Committed(seq=3, tensors=_tensors())
    sent = {"b": torch.zeros(256, dtype=torch.bfloat16)}
    for pending in (Pending(base_seq=None, dense=dict(sent)), Pending(base_seq=2, dense=dict(sent))):
        after = pending.commit(base, 9)
        assert after.seq == 9 and set(after.tensors) == {"b"}


def test_what_a_session_holds_until_its_commit_is_its_encoded_deltas():
    base = _tensors()["a"]
    new = base.clone()
    new.view(-1)[:10] += 1
    _, d = D.diff(new, base)
    assert d is not None
    pending = Pending(base_seq=1, deltas={"a": d})
    assert pending.nbytes == d.blob.numel() == 10 * 4 + 10 * 2


def test_a_commit_keeps_the_delta_beside_the_snapshot_until_the_next_compare_writes_it():
    v0 = _tensors()
    base = Committed(seq=3, tensors={n: t.clone() for n, t in v0.items()})
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["a"].view(-1)[[7, 900]] += 1
    _, d = D.diff(v1["a"], base.tensors["a"])
    after = Pending(base_seq=3, deltas={"a": d}).commit(base, 4)
    assert after.unapplied == {"a": d} and torch.equal(
        D.bits(after.tensors["a"]), D.bits(v0["a"])
    )  # no pass at the commit
    assert after.nbytes == sum(t.numel() * 2 for t in v0.values()) + d.blob.numel()
    v2 = v1["a"].clone()
    v2.view(-1)[5] += 1
    k, d2, _ = D.diff_checked(v2, after.tensors["a"], after.unapplied.pop("a"))
    assert k == 1 and d2 is not None  # against the committed bits, not the stale ones
    assert torch.equal(D.bits(after.tensors["a"]), D.bits(v1["a"]))


def test_the_committed_bits_of_a_tensor_are_its_snapshot_with_its_unapplied_delta():
    v0 = _tensors()["a"]
    v1 = v0.clone()
    v1.view(-1)[3] += 1
    _, d = D.diff(v1, v0)
    snap = Committed(seq=1, tensors={"a": v0.clone()}, unapplied={"a": d})
    assert torch.equal(D.bits(snap.tensor("a")), D.bits(v1)) and not snap.unapplied


def test_a_tensor_sent_dense_drops_its_unapplied_delta():
    v0 = _tensors()["a"]
    v1 = v0.clone()
    v1.view(-1)[3] += 1
    _, d = D.diff(v1, v0)
    snap = Committed(seq=1, tensors={"a": v0.clone()}, unapplied={"a": d})
    whole = torch.zeros_like(v0)
    after = Pending(base_seq=1, dense={"a": whole}).commit(snap, 2)
    assert not after.unapplied and after.tensor("a") is whole


def _committed_with_deltas() -> tuple[Committed, dict[str, torch.Tensor]]:
    v0 = _tensors()
    base = Committed(seq=3, tensors={n: t.clone() for n, t in v0.items()})
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["a"].view(-1)[[7, 900, 4000]] += 1
    v1["b"].view(-1)[[0, 255]] += 1
    deltas = {}
    for n in v1:
        _, d = D.diff(v1[n], base.tensors[n])
        assert d is not None
        deltas[n] = d
    return Pending(base_seq=3, deltas=deltas).commit(base, 4), v1


def test_after_a_commit_a_thread_writes_every_delta_onto_the_snapshot():
    after, v1 = _committed_with_deltas()
    after.write_behind()
    after.settle()
    assert not after.unapplied and after.broken is None
    assert all(torch.equal(D.bits(after.tensors[n]), D.bits(v1[n])) for n in v1)


def test_a_compare_that_reaches_a_tensor_the_thread_is_writing_waits_for_it_and_reads_the_committed_bits(
    monkeypatch,
):
    after, v1 = _committed_with_deltas()
    first = next(iter(after.unapplied))
    writing, go_on = threading.Event(), threading.Event()
    apply_to = D.Delta.apply_to

    def gated(self, out):  # the real write, held open while the test looks
        if out is after.tensors[first]:
            writing.set()
            assert go_on.wait(10)
        apply_to(self, out)

    monkeypatch.setattr(D.Delta, "apply_to", gated)
    after.write_behind()
    assert writing.wait(10)
    taken: list[object] = []
    reader = threading.Thread(target=lambda: taken.append(after.take(first)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive(), "take() returned while the thread was still writing the tensor"
    go_on.set()
    reader.join(10)
    assert taken == [None]  # the thread wrote it: nothing left for the compare to write
    after.settle()
    assert torch.equal(D.bits(after.tensors[first]), D.bits(v1[first]))


def test_a_write_that_fails_leaves_the_snapshot_broken_and_the_next_commit_keeps_only_what_it_sent(monkeypatch):
    after, _ = _committed_with_deltas()

    def fails(self, out):
        raise RuntimeError("no memory")

    monkeypatch.setattr(D.Delta, "apply_to", fails)
    after.write_behind()
    after.settle()
    assert after.broken is not None and "no memory" in after.broken
    sent = {"b": torch.zeros(256, dtype=torch.bfloat16)}
    again = Pending(base_seq=4, dense=dict(sent)).commit(after, 5)
    assert again is not after and set(again.tensors) == {"b"} and again.broken is None


def test_a_delta_update_is_cut_into_at_most_delta_groups_ordered_groups_of_about_equal_bytes(monkeypatch, path):
    from rlbus.sdk import push as P

    named = [(f"t{i}", torch.empty(n, dtype=torch.uint8)) for i, n in enumerate([5, 5, 5, 5, 5, 5, 5, 5, 40])]
    assert P.delta_groups([]) == [[]]
    assert [[n for n, _ in g] for g in P.delta_groups(named)] == [[n for n, _ in named]], "small: one group"
    monkeypatch.setattr(P, "DELTA_GROUP_MIN_BYTES", 1)
    groups = P.delta_groups(named)
    assert len(groups) <= P.DELTA_GROUPS and [nt for g in groups for nt in g] == named
    assert [sum(t.numel() for _, t in g) for g in groups] == [10, 10, 10, 10, 40]  # 8 groups: 10 bytes each
    monkeypatch.setattr(P, "DELTA_GROUPS", 4)
    assert [sum(t.numel() for _, t in g) for g in P.delta_groups(named)] == [20, 20, 40]
