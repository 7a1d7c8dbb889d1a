"""The trainer's copy of the committed bits (rlbus.sdk.snapshot): it moves only at a commit,
and only along the session that was taken against it."""

from __future__ import annotations

import torch

from rlbus.sdk.snapshot import Committed, Pending
from rlbus.transfer import delta as D


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
    assert all(torch.equal(D.bits(after.tensors[n]), D.bits(new[n])) for n in new)


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
