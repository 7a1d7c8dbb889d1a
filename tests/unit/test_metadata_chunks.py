"""update_weights splits metadata so no message passes NATS' payload limit."""

from __future__ import annotations

import torch
from rlbus.schemas import UpdateWeights, encode

from rlbus.sdk.push import meta_chunks
from rlbus.transfer.stream import prepare

MAX_META_BYTES = 512 * 1024


def test_a_model_with_many_tensors_is_sent_in_several_metadata_messages_under_the_limit():
    named = [(f"layers.{i}.some_rather_long_parameter_name.weight", torch.zeros(4, 4)) for i in range(12000)]
    plan = prepare(named, 1 << 16)
    chunks = list(meta_chunks(plan.per_bucket, MAX_META_BYTES))
    assert len(chunks) > 1
    assert chunks[0][0] == 0 and chunks[-1][1] == len(plan.per_bucket)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), "chunks must be consecutive and cover every bucket"
    for first, last in chunks:
        params = [m for k in range(first, last) for m in plan.per_bucket[k]]
        assert len(encode(UpdateWeights(params=params))) < MAX_META_BYTES


def test_a_small_model_is_one_message():
    plan = prepare([("w", torch.zeros(8))], 1 << 20)
    assert list(meta_chunks(plan.per_bucket, MAX_META_BYTES)) == [(0, 1)]


def test_a_bucket_never_holds_more_tensors_than_one_message_can_describe():
    named = [(f"t{i}", torch.zeros(1)) for i in range(20000)]  # 20,000 tiny tensors fit one 16 MiB bucket
    limit = 64 * 1024
    plan = prepare(named, 16 << 20, max_tensors=limit // 200)
    assert len(plan.per_bucket) > 1 and max(len(b) for b in plan.per_bucket) <= limit // 200
    for first, last in meta_chunks(plan.per_bucket, limit):
        params = [m for k in range(first, last) for m in plan.per_bucket[k]]
        assert len(encode(UpdateWeights(params=params))) < limit
