"""Bucket planning, packing and checksums (no groups, no processes)."""

from __future__ import annotations

import pytest
import torch
from rlbus.schemas import BucketMeta, ParamMeta

from rlbus.transfer import (
    ChecksumMismatch,
    PlanError,
    UnsupportedDType,
    checksum,
    dtype_name,
    pack,
    plan,
    torch_dtype,
    trainer_transfer,
    unpack,
    validate,
    worker_transfer,
)
from rlbus.transfer.buckets import ALIGN, by_bucket, copy_out
from rlbus.transfer.stream import SEND_SOLO_BYTES, pack_all, prepare, prepare_for, solo_bytes, verify
from rlbus.transfer.torchdist import TorchDistTrainer

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def mixed_model() -> list[tuple[str, torch.Tensor]]:
    named = [(f"p.{d}".replace("torch.", ""), _tensor(d, (3, 5), i)) for i, d in enumerate(DTYPES)]
    named.append(("scalar", torch.tensor(3.5, dtype=torch.bfloat16)))
    named.append(("flag", torch.tensor(True)))
    named.append(("empty", torch.empty(0, 4)))
    named.append(("transposed", torch.arange(24, dtype=torch.float32).reshape(4, 6).t()))
    named.append(("strided", torch.arange(40, dtype=torch.int16)[::3]))
    return named


def round_trip(named, bucket_bytes):
    metas, sizes = plan(named, bucket_bytes)
    lookup = dict(named)
    out = {}
    for k, size in enumerate(sizes):
        buf = torch.full((size,), 0xAB, dtype=torch.uint8)
        pack(k, metas, lookup, buf)
        for name, view in unpack(buf, [m for m in metas if m.bucket == k]):
            out[name] = view.clone()
    return out


@pytest.mark.parametrize("bucket_bytes", [64, 200, 1 << 20])
def test_pack_unpack_round_trip_is_bit_identical_for_every_dtype(bucket_bytes):
    named = mixed_model()
    out = round_trip(named, bucket_bytes)
    assert sorted(out) == sorted(n for n, _ in named)  # every tensor, once (in bucket order)
    for name, t in named:
        got = out[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name


def test_plan_keeps_input_order_and_aligns_every_offset():
    metas, sizes = plan(mixed_model(), 256)
    assert [m.name for m in metas] == [n for n, _ in mixed_model()]
    assert all(m.offset % ALIGN == 0 for m in metas)
    shared = [m for m in metas if len([o for o in metas if o.bucket == m.bucket]) > 1]
    assert [(m.bucket, m.offset) for m in shared] == sorted((m.bucket, m.offset) for m in shared)
    assert sorted({m.bucket for m in metas}) == list(range(len(sizes)))


def test_a_tensor_of_a_quarter_of_a_bucket_or_more_travels_alone_and_small_ones_share_around_it():
    named = [
        ("a", torch.zeros(12)),  # 48 bytes: just under a quarter of 200
        ("quarter", torch.zeros(13)),  # 52 bytes
        ("b", torch.zeros(12)),
        ("big", torch.zeros(300)),
        ("c", torch.zeros(12)),
    ]
    metas, sizes = plan(named, 200)
    by_name = {m.name: m for m in metas}
    for solo in ("quarter", "big"):
        m = by_name[solo]
        assert m.offset == 0 and [o.name for o in metas if o.bucket == m.bucket] == [solo]
        assert sizes[m.bucket] == m.nbytes
    # the small tensors are not split up by the big ones between them: one shared bucket
    assert by_name["a"].bucket == by_name["b"].bucket == by_name["c"].bucket
    assert [by_name[n].offset for n in "abc"] == [0, 64, 128]
    assert len(sizes) == 3


def test_a_smaller_solo_size_sends_more_tensors_alone_and_a_larger_one_never_overfills_a_bucket():
    named = [("a", torch.zeros(10)), ("mid", torch.zeros(20)), ("b", torch.zeros(10)), ("over", torch.zeros(60))]
    metas, sizes = plan(named, 200, solo_bytes=80)  # "mid" (80 bytes) alone, under a quarter of 200
    by_name = {m.name: m for m in metas}
    assert [o.name for o in metas if o.bucket == by_name["mid"].bucket] == ["mid"]
    assert by_name["a"].bucket == by_name["b"].bucket
    # asked for more than a bucket, a tensor over bucket_bytes still travels alone, never packed past it
    metas, sizes = plan(named, 200, solo_bytes=10_000)
    over = next(m for m in metas if m.name == "over")
    assert [o.name for o in metas if o.bucket == over.bucket] == ["over"] and sizes[over.bucket] == 240
    assert all(size <= 200 for k, size in enumerate(sizes) if k != over.bucket)
    with pytest.raises(PlanError, match="solo_bytes"):
        plan(named, 200, solo_bytes=0)


def test_a_transport_that_sends_point_to_point_plans_tensors_of_a_mebibyte_alone():
    bucket = 16 << 20
    sends, broadcasts = TorchDistTrainer("gloo"), TorchDistTrainer("gloo", broadcasts=True)
    assert solo_bytes(sends, bucket) == SEND_SOLO_BYTES < bucket // 4
    assert solo_bytes(broadcasts, bucket) == bucket // 4
    assert solo_bytes(trainer_transfer("shm"), bucket) == bucket // 4  # shm packs every bucket anyway
    assert solo_bytes(sends, 1 << 20) == 1 << 18  # never more than a quarter of a small bucket
    named = [("small", torch.zeros(16)), ("two_mib", torch.zeros(1 << 19)), ("tiny", torch.zeros(16))]
    sent, broadcast = prepare_for(sends, named, bucket), prepare_for(broadcasts, named, bucket)
    assert sorted([m.name for m in ms] for ms in sent.per_bucket) == [["small", "tiny"], ["two_mib"]]  # 2 MiB alone
    assert [len(ms) for ms in broadcast.per_bucket] == [3]  # under a quarter of 16 MiB: packed


def test_bucket_plan_never_exceeds_bucket_size_except_for_one_big_tensor():
    named = [("a", torch.zeros(10)), ("big", torch.zeros(1000)), ("b", torch.zeros(30)), ("c", torch.zeros(30))]
    metas, sizes = plan(named, 200)
    big = next(m for m in metas if m.name == "big")
    assert sizes[big.bucket] == 4000  # exactly the tensor
    assert [m.name for m in metas if m.bucket == big.bucket] == ["big"]
    for k, size in enumerate(sizes):
        if k != big.bucket:
            assert size <= 200
            assert all(m.offset + m.nbytes <= size for m in metas if m.bucket == k)


def test_a_tensor_travelling_alone_has_a_bucket_of_exactly_its_size():
    _, sizes = plan([("x", torch.zeros(1001, dtype=torch.uint8))], 100)
    assert sizes == [1001]


def test_pad_bytes_are_zeroed_so_checksums_are_deterministic():
    named = [("a", torch.ones(3, dtype=torch.uint8)), ("b", torch.ones(5, dtype=torch.uint8))]
    metas, sizes = plan(named, 1 << 10)
    dirty = torch.full((sizes[0],), 0xFF, dtype=torch.uint8)
    clean = torch.zeros(sizes[0], dtype=torch.uint8)
    pack(0, metas, dict(named), dirty)
    pack(0, metas, dict(named), clean)
    assert torch.equal(dirty, clean)
    assert checksum(dirty) == checksum(clean)


def test_checksum_changes_when_one_byte_changes():
    buf = torch.arange(4096, dtype=torch.int64).view(torch.uint8).clone()
    before = checksum(buf)
    buf[12345] ^= 1
    assert checksum(buf) != before
    assert checksum(buf) == checksum(buf.clone())


def test_checksum_refuses_non_byte_or_strided_buffers():
    with pytest.raises(ValueError):
        checksum(torch.zeros(4))
    with pytest.raises(ValueError):
        checksum(torch.zeros(8, dtype=torch.uint8)[::2])


def test_dtype_names_round_trip_and_unknown_ones_are_refused():
    for d in DTYPES:
        assert torch_dtype(dtype_name(d)) == d
    with pytest.raises(UnsupportedDType):
        dtype_name(torch.complex64)
    with pytest.raises(UnsupportedDType):
        torch_dtype("float8")
    with pytest.raises(UnsupportedDType):
        plan([("c", torch.zeros(2, dtype=torch.complex64))], 1024)


def test_plan_refuses_duplicate_names_and_pack_refuses_changed_tensors():
    with pytest.raises(PlanError):
        plan([("a", torch.zeros(1)), ("a", torch.zeros(1))], 64)
    metas, sizes = plan([("a", torch.zeros(4))], 64)
    with pytest.raises(PlanError):
        pack(0, metas, {"a": torch.zeros(5)}, torch.empty(sizes[0], dtype=torch.uint8))


def test_pack_all_matches_per_bucket_checksums():
    named = mixed_model()
    p = prepare(named, 128)
    packed = pack_all(p, named)
    assert [b.index for b in p.buckets] == list(range(len(p.bucket_sizes)))
    assert [b.nbytes for b in p.buckets] == p.bucket_sizes
    assert all(b.data_ptr() % ALIGN == packed.pool.data_ptr() % ALIGN for b in packed.buffers)
    for size, sum_, buf in zip(p.bucket_sizes, packed.checksums, packed.buffers):
        assert sum_ == checksum(buf) and size == buf.numel()
    again = pack_all(p, named, pool=packed.pool)
    assert again.pool is packed.pool and again.checksums == packed.checksums


def test_validate_accepts_a_real_plan_and_rejects_inconsistent_metadata():
    named = mixed_model()
    p = prepare(named, 256)
    validate(p.params, p.buckets)
    a = ParamMeta(name="a", dtype="float32", shape=[4], bucket=0, offset=0, nbytes=16)
    b = BucketMeta(index=0, nbytes=64)
    with pytest.raises(PlanError):  # overlap
        validate([a, ParamMeta(name="b", dtype="float32", shape=[4], bucket=0, offset=8, nbytes=16)], [b])
    with pytest.raises(PlanError):  # nbytes does not match shape
        validate([ParamMeta(name="a", dtype="float32", shape=[5], bucket=0, offset=0, nbytes=16)], [b])
    with pytest.raises(PlanError):  # outside its bucket
        validate([ParamMeta(name="a", dtype="float32", shape=[4], bucket=0, offset=56, nbytes=16)], [b])
    with pytest.raises(PlanError):  # bucket out of range
        validate([ParamMeta(name="a", dtype="float32", shape=[4], bucket=1, offset=0, nbytes=16)], [b])
    with pytest.raises(PlanError):  # buckets out of order
        validate([], [BucketMeta(index=1, nbytes=1)])


def test_by_bucket_groups_in_offset_order():
    metas, sizes = plan(mixed_model(), 128)
    groups = by_bucket(metas, len(sizes))
    assert sum(map(len, groups)) == len(metas)
    for k, g in enumerate(groups):
        assert all(m.bucket == k for m in g)
        assert [m.offset for m in g] == sorted(m.offset for m in g)


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError):
        trainer_transfer("carrier-pigeon")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        worker_transfer("carrier-pigeon")  # type: ignore[arg-type]


def test_verify_names_the_first_bad_bucket_and_a_missing_one():
    verify(["a", "b"], ["a", "b"])
    with pytest.raises(ChecksumMismatch) as err:
        verify(["a", "x", "y"], ["a", "b", "c"])
    assert err.value.bucket == 1 and err.value.others == (2,)
    with pytest.raises(ChecksumMismatch, match="2 buckets were received, the trainer's checksums cover 3"):
        verify(["a", "b"], ["a", "b", "c"])


def test_copy_out_fills_destinations_and_hands_back_views_where_it_cannot():
    named = [
        ("a", torch.arange(6, dtype=torch.float32)),
        ("b", torch.arange(4, dtype=torch.int16)),
        ("c", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
    ]
    metas, sizes = plan(named, 1 << 20)
    buf = pack(0, metas, dict(named), torch.empty(sizes[0], dtype=torch.uint8))
    into = {"a": torch.zeros(6), "c": torch.zeros(3, 2).t()}  # no "b"; "c" strided
    got = dict(copy_out(buf, metas, into))
    assert got["a"] is into["a"] and torch.equal(into["a"], named[0][1])
    assert torch.equal(got["b"], named[1][1]) and got["b"].data_ptr() != named[1][1].data_ptr()
    assert got["c"] is not into["c"] and torch.equal(got["c"], named[2][1]) and not into["c"].any()
