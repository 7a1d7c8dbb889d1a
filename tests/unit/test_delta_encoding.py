"""Delta encoding (rlbus.transfer.delta): bit-exact round trips, the smallest form, and
refusal of bytes that do not decode. Every test runs twice: on the host path (numpy's scan,
numpy's writes) and on the device path (torch ops, what GPU tensors take) forced on CPU tensors."""

from __future__ import annotations

import importlib

import msgspec
import pytest
import torch
from rlbus.schemas import BucketMeta, ParamMeta

from rlbus.transfer import delta as D
from rlbus.transfer.base import PlanError
from rlbus.transfer.buckets import unpack, validate
from rlbus.transfer.checksum import checksum

checksums = importlib.import_module("rlbus.transfer.checksum")  # the module (rlbus.transfer exports the function)


@pytest.fixture(autouse=True, params=["host", "device"])
def path(request, monkeypatch) -> str:
    if request.param == "device":
        monkeypatch.setenv(D.DEVICE_ENV, "device")
    return request.param


def _planned(d: D.Delta, offset: int = 0) -> ParamMeta:
    n = d.blob.numel()
    return d.meta(ParamMeta(name="w", dtype="uint8", shape=[n], bucket=0, offset=offset, nbytes=n))


def _round_trip(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    d = D.encode(new, base)
    if d is None:  # dense is no bigger (a tiny tensor): it travels as it is
        return new.clone()
    out = base.clone()
    if d.changed:
        pos, values = D.decode(d.blob, _planned(d))
        D.apply(out, pos, values)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(D.bits(a.contiguous()), D.bits(b.contiguous()))


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64]
)
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])
def test_a_sparse_change_round_trips_bit_for_bit(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    base = (torch.randn(numel, generator=g) * 100).to(dtype)
    new = base.clone()
    idx = torch.randperm(numel, generator=g)[: max(1, numel // 100)]
    new[idx] = (torch.randn(idx.numel(), generator=g) * 100).to(dtype)
    assert _same_bits(_round_trip(new, base), new)


def test_bits_not_float_equality_decide_what_changed():
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0, 3.0, 4.0, 5.0, 6.0] * 8, dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0  # equal as floats, other bits
    new[2] = 1.0  # same bits
    assert D.changed_positions(new, base).tolist() == [0]  # NaN == NaN bitwise: unchanged
    assert _same_bits(_round_trip(new, base), new)


def test_an_unchanged_tensor_has_an_empty_delta():
    base = torch.randn(64, 32).to(torch.bfloat16)
    d = D.encode(base.clone(), base)
    assert d is not None and d.changed == 0


def test_a_tensor_that_changed_entirely_goes_dense():
    base = torch.randn(4096).to(torch.bfloat16)
    assert D.encode(base + 1, base) is None


def test_indices_while_they_beat_dense_then_a_bitmap():
    base = torch.zeros(80_000, dtype=torch.bfloat16)
    few, some, many = base.clone(), base.clone(), base.clone()
    few[::1000] = 1
    some[::5] = 1  # 20%: a bitmap would be smaller, but it costs a pass over every element to apply
    many[::2] = 1
    f, s, m = D.encode(few, base), D.encode(some, base), D.encode(many, base)
    assert f is not None and f.index == "int32" and f.blob.numel() == 80 * 4 + 80 * 2
    assert s is not None and s.index == "int32" and s.blob.numel() == 16_000 * 6
    assert m is not None and m.index == "bitmap" and m.blob.numel() == 10_000 + 40_000 * 2
    assert _same_bits(_round_trip(many, base), many)


def test_odd_sizes_and_strided_tensors_compare_element_wise():
    base = torch.randn(3, 5).to(torch.float16)  # 30 bytes: no 8-byte words
    new = base.clone()
    new[1, 2] += 1
    assert D.changed_positions(new, base).tolist() == [7]
    t = torch.randn(8, 8)
    assert D.changed_positions(t.t(), t.t().clone()).numel() == 0


def test_the_wire_metadata_describes_the_blob_and_validates():
    base = torch.randn(16, 64).to(torch.bfloat16)
    new = base.clone()
    new[3, 5] = 7
    d = D.encode(new, base)
    assert d is not None
    m = _planned(d, offset=64)
    assert (m.dtype, m.shape, m.encoding, m.changed, m.index_nbytes, m.values_offset) == (
        "bfloat16",
        [16, 64],
        "delta",
        1,
        4,
        8,
    )
    validate([m], [BucketMeta(index=0, nbytes=64 + m.nbytes)])
    buf = torch.zeros(64 + m.nbytes, dtype=torch.uint8)
    buf[64:].copy_(d.blob)
    [(name, raw)] = unpack(buf, [m])
    assert name == "w" and raw.dtype == torch.uint8 and raw.numel() == m.nbytes  # raw bytes, for decode


def test_inconsistent_delta_metadata_is_refused_before_bytes_move():
    base = torch.randn(100).to(torch.bfloat16)
    new = base.clone()
    new[1] = 3
    d = D.encode(new, base)
    assert d is not None
    m = _planned(d)
    for bad in (
        dict(changed=0),
        dict(changed=101),
        dict(index_nbytes=8),
        dict(values_offset=4),
        dict(nbytes=m.nbytes + 2),
    ):
        with pytest.raises(PlanError):
            validate([msgspec.structs.replace(m, **bad)], [BucketMeta(index=0, nbytes=256)])


def test_corrupted_indices_do_not_decode():
    base = torch.randn(100).to(torch.bfloat16)
    new = base.clone()
    new[[5, 9]] = 3
    d = D.encode(new, base)
    assert d is not None
    m = _planned(d)
    for corrupt in ([5, 100], [9, 5], [-1, 5]):
        blob = d.blob.clone()
        blob[:8].view(torch.int32).copy_(torch.tensor(corrupt, dtype=torch.int32))
        with pytest.raises(D.DeltaError):
            D.decode(blob, m)


def test_a_bitmap_that_disagrees_with_its_count_does_not_decode():
    base = torch.zeros(100, dtype=torch.bfloat16)
    new = base.clone()
    new[::2] = 1
    d = D.encode(new, base)
    assert d is not None and d.index == "bitmap"
    m = _planned(d)
    blob = d.blob.clone()
    blob[0] |= 0b10  # one more element marked
    with pytest.raises(D.DeltaError):
        D.decode(blob, m)
    blob = d.blob.clone()
    blob[12] |= 0b1000_0000  # bit 103: past the tensor
    with pytest.raises(D.DeltaError):
        D.decode(blob, m)


def test_the_base_must_have_the_tensors_dtype_and_shape():
    with pytest.raises(PlanError):
        D.encode(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float16))
    with pytest.raises(PlanError):
        D.encode(torch.zeros(4), torch.zeros(2, 2))


@pytest.mark.parametrize("fraction", [0.001, 0.2, 0.7])
def test_write_applies_either_index_onto_the_base_in_place(fraction):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3 * D._CHUNK + 13, generator=g).to(torch.bfloat16)  # several chunks and a ragged end
    new = base.clone()
    idx = torch.randperm(new.numel(), generator=g)[: int(new.numel() * fraction)]
    new[idx] = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
    d = D.encode(new, base)
    assert d is not None and d.index == ("int32" if fraction < 0.3 else "bitmap")
    out = base.clone()
    D.write(out, d.blob, _planned(d))
    assert _same_bits(out, new)


def test_write_refuses_a_bitmap_whose_count_is_wrong_before_writing():
    base = torch.zeros(100, dtype=torch.bfloat16)
    new = base.clone()
    new[::2] = 1
    d = D.encode(new, base)
    assert d is not None and d.index == "bitmap"
    blob = d.blob.clone()
    blob[0] |= 0b10
    out = base.clone()
    with pytest.raises(D.DeltaError):
        D.write(out, blob, _planned(d))
    assert _same_bits(out, base)


# --- the host scan: 8-byte words a slice at a time, the result's checksum in the same pass --------------------


def _changed(base: torch.Tensor, where: list[int]) -> torch.Tensor:
    new = base.clone()
    flat = D.bits(new)
    flat[where] = flat[where] ^ 1  # one bit: the smallest change there is
    return new


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 8 words: a small tensor crosses many of them."""
    monkeypatch.setattr(D, "SCAN_WORDS", 8)
    monkeypatch.setattr(D, "_CHUNK", 16)  # the torch path's chunks (host tensors), a multiple of 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.int64])
def test_changes_on_either_side_of_every_slice_boundary_are_found_with_the_checksum(small_slices, dtype):
    per_word = 8 // dtype.itemsize
    numel = 8 * per_word * 7  # seven slices of 8 words
    base = torch.arange(numel).to(dtype)
    edges = sorted({e for s in range(0, numel, 8 * per_word) for e in (s - 1, s, s + per_word - 1) if 0 <= e < numel})
    new = _changed(base, edges)
    k, d, digest = D.diff_checked(new, base)
    assert k == len(edges) and d is not None and d.index == "int32"
    assert d.blob[: 4 * k].view(torch.int32).tolist() == edges
    assert digest == checksum(D.bits(new).view(torch.uint8))
    assert _same_bits(_round_trip(new, base), new)
    assert D.diff(new, base)[1].blob.equal(d.blob)


def test_without_xxhashs_c_api_the_checksum_is_taken_in_a_second_pass(small_slices, monkeypatch):
    """The scan hashes through the xxhash wheel's C API; a wheel without it costs a second read, not the checksum."""
    monkeypatch.setattr(checksums, "native_stream", lambda: None)
    base = torch.arange(4096).to(torch.bfloat16)
    new = _changed(base, [0, 100, 4095])
    k, d, digest = D.diff_checked(new, base)
    assert k == 3 and d is not None and digest == checksum(D.bits(new).view(torch.uint8))


def test_nothing_changed_gives_an_empty_delta_and_no_checksum(small_slices):
    base = torch.randn(1000).to(torch.bfloat16)
    k, d, digest = D.diff_checked(base.clone(), base)
    assert (k, digest) == (0, "") and d is not None and d.changed == 0 and d.blob.numel() == 0


def test_everything_changed_goes_dense_without_a_checksum(small_slices):
    base = torch.randn(1000).to(torch.bfloat16)
    k, d, digest = D.diff_checked(base + 1, base)
    assert (k, d, digest) == (1000, None, "")


@pytest.mark.parametrize("dtype, every", [(torch.float32, 2), (torch.bfloat16, 3)])
def test_many_changed_gives_a_bitmap_with_the_checksum(small_slices, dtype, every):
    base = torch.zeros(4096, dtype=dtype)
    new = base.clone()
    new[::every] = 1  # float32 1/2: int32 indices cost as much as dense; bf16 2/3: past what the scan lists
    new[1::every] = 1 if every == 3 else 0
    k, d, digest = D.diff_checked(new, base)
    assert k == D.changed_positions(new, base).numel() and d is not None and d.index == "bitmap"
    assert digest == checksum(D.bits(new).view(torch.uint8))
    assert _same_bits(_round_trip(new, base), new)


def test_bytes_that_are_not_whole_words_still_get_the_checksum():
    base = torch.randn(3, 5).to(torch.float16)  # 30 bytes
    new = base.clone()
    new[2, 4] += 1
    k, d, digest = D.diff_checked(new, base)
    assert k == 1 and d is not None and digest == checksum(new.reshape(-1).view(torch.uint8))


# --- the last commit's delta, written onto the base by the next compare ---------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("second", ["few", "none", "all"])
def test_a_delta_under_the_base_is_written_slice_by_slice_before_the_compare(small_slices, dtype, second):
    g = torch.Generator().manual_seed(7)
    v0 = torch.randn(2000, generator=g).to(dtype)
    v1 = _changed(v0, [0, 5, 63, 64, 65, 700, 1999])  # the commit the snapshot has not taken yet
    v2 = {"few": _changed(v1, [3, 64, 1500]), "none": v1.clone(), "all": v1 + 1}[second]
    under = D.encode(v1, v0)
    assert under is not None and under.index == "int32"
    snapshot = v0.clone()
    k, d, digest = D.diff_checked(v2, snapshot, under)
    assert _same_bits(snapshot, v1)  # it holds the commit, however the compare went
    want_k, want = D.diff(v2, v1)
    assert k == want_k and (d is None) == (want is None)
    if d is not None:
        assert d.blob.equal(want.blob)
        assert digest == (checksum(D.bits(v2).view(torch.uint8)) if k else "")


def test_a_delta_under_a_base_of_odd_bytes_is_written_first():
    v0 = torch.randn(3, 5).to(torch.float16)
    v1 = _changed(v0, [2])
    under = D.encode(v1, v0)
    assert under is not None
    snapshot = v0.clone()
    k, _, _ = D.diff_checked(_changed(v1, [9]), snapshot, under)
    assert k == 1 and _same_bits(snapshot, v1)


def test_a_base_that_does_not_match_still_takes_the_delta_handed_over():
    v0 = torch.randn(64).to(torch.bfloat16)
    under = D.encode(_changed(v0, [1]), v0)
    snapshot = v0.clone()
    with pytest.raises(PlanError):
        D.diff_checked(torch.zeros(32, dtype=torch.bfloat16), snapshot, under)
    assert _same_bits(snapshot, _changed(v0, [1]))


def test_write_refuses_int32_indices_out_of_order_before_writing():
    base = torch.randn(5000).to(torch.bfloat16)
    new = _changed(base, [10, 20, 4000])
    d = D.encode(new, base)
    assert d is not None and d.index == "int32"
    for corrupt in ([20, 10, 4000], [10, 20, 5000], [-3, 20, 4000], [10, 10, 4000]):
        blob = d.blob.clone()
        blob[:12].view(torch.int32).copy_(torch.tensor(corrupt, dtype=torch.int32))
        out = base.clone()
        with pytest.raises(D.DeltaError):
            D.write(out, blob, _planned(d))
        assert _same_bits(out, base)


def test_the_device_path_compares_encodes_and_applies_with_torch_ops(monkeypatch):
    """Forced on host tensors, nothing of numpy's host path runs, and the result is the same."""
    monkeypatch.setenv(D.DEVICE_ENV, "device")  # under either `path`: this test is about the device path

    def no_numpy(*args, **kwargs):
        raise AssertionError("the host path ran")

    monkeypatch.setattr(D, "_scan", no_numpy)
    monkeypatch.setattr(D, "_ascending", no_numpy)
    monkeypatch.setattr(D, "_CHUNK", 64)
    base = torch.randn(1000).to(torch.bfloat16)
    new = _changed(base, [0, 63, 64, 65, 500, 999])
    k, d, digest = D.diff_checked(new, base)
    assert k == 6 and d is not None and d.index == "int32" and digest == checksum(new.view(torch.uint8))
    out = base.clone()
    D.write(out, d.blob, _planned(d))
    assert _same_bits(out, new)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("base_on", ["cuda", "pinned"])
def test_a_gpu_tensor_is_compared_on_the_gpu_against_a_base_there_or_in_pinned_memory(base_on):
    base = torch.randn(1 << 20).to(torch.bfloat16)
    new = _changed(base, [1, 2, 4096, 1 << 19])
    gpu_base = base.cuda() if base_on == "cuda" else base.pin_memory()
    k, d, digest = D.diff_checked(new.cuda(), gpu_base)
    assert k == 4 and d is not None and d.blob.device.type == "cuda"
    assert digest == checksum(new.view(torch.uint8), "device")
    out = base.cuda()
    D.write(out, d.blob, _planned(d))
    assert _same_bits(out.cpu(), new)


# --- many tensors in one compiled call (what a push's compare thread does) ------------------------------------


def _batch() -> list[tuple[torch.Tensor, torch.Tensor, D.Delta | None]]:
    """(new, base, under) of every kind a push meets: sparse bf16 and float32 changes with and
    without the last commit's delta under the base, nothing or everything changed, a bitmap's
    worth, odd bytes, a strided tensor."""
    g = torch.Generator().manual_seed(11)
    out: list[tuple[torch.Tensor, torch.Tensor, D.Delta | None]] = []
    for dtype, numel, where in [
        (torch.bfloat16, 4000, [0, 1, 63, 64, 2000, 3999]),
        (torch.float32, 3000, list(range(0, 3000, 7))),
        (torch.bfloat16, 1024, []),
        (torch.float16, 15, [3]),  # 30 bytes: not whole words
    ]:
        v0 = torch.randn(numel, generator=g).to(dtype)
        v1 = _changed(v0, [1, 5, numel - 1])
        under = D.encode(v1, v0)
        out.append((_changed(v1, where), v0.clone(), under))  # base v0 + under = v1, the committed bits
        out.append((_changed(v0, where), v0.clone(), None))
    base = torch.zeros(4096, dtype=torch.bfloat16)
    many = base.clone()
    many[::3], many[1::3] = 1, 1
    out += [(many, base, None), (base + 1, base.clone(), None)]
    wide = torch.randn(8, 16).to(torch.bfloat16)
    out.append((_changed(wide, [5]).t(), wide.t().contiguous(), None))  # strided: compared element-wise
    return out


def _committed(item: tuple[torch.Tensor, torch.Tensor, D.Delta | None]) -> torch.Tensor:
    new, base, under = item
    want = base.clone()
    if under is not None:
        under.apply_to(want)
    return want


@pytest.mark.parametrize("chunk", [D.BLOB_CHUNK, 64])
def test_many_tensors_compared_at_once_equal_each_compared_alone(small_slices, monkeypatch, chunk):
    """diff_many (one compiled call a width, the blobs side by side in one buffer; a tiny buffer
    makes it start a new one for nearly every tensor) gives each tensor what diff_checked gives:
    the count, the same blob, the checksum, and its base holding the delta that was under it."""
    monkeypatch.setattr(D, "BLOB_CHUNK", chunk)
    items = _batch()
    alone = [(n, b.clone(), u) for n, b, u in items]
    want = [D.diff_checked(*it, "xxh3") for it in alone]
    got = D.diff_many(items, "xxh3")
    for (k, d, digest), (wk, wd, wdigest), it, wit in zip(got, want, items, alone):
        assert (k, digest) == (wk, wdigest) and (d is None) == (wd is None)
        if d is not None:
            assert (d.index, d.changed) == (wd.index, wd.changed) and d.blob.equal(wd.blob)
            assert _same_bits(_round_trip(it[0], wit[1]), it[0])
        assert _same_bits(it[1], wit[1])


def test_many_tensors_compared_at_once_leave_every_base_holding_its_delta_when_one_fails(small_slices, monkeypatch):
    """A failure part-way (the first result, or a tensor compared on its own) still writes every
    last commit's delta onto its base: the trainer's copy stays the committed bits."""
    items = _batch()
    want = [_committed(it) for it in items]
    calls: list[str] = []

    def second_fails(f):
        def call(*a, **k):
            calls.append(f.__name__)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return f(*a, **k)

        return call

    monkeypatch.setattr(D, "_kept", second_fails(D._kept))
    monkeypatch.setattr(D, "diff_checked", second_fails(D.diff_checked))
    with pytest.raises(RuntimeError, match="boom"):
        D.diff_many(items, "xxh3")
    assert all(_same_bits(it[1], w) for it, w in zip(items, want))


def test_the_blobs_of_many_compared_at_once_share_one_buffer_and_each_decodes(small_slices, path):
    """On the host the blobs are views of one buffer, each its own contiguous bytes, planned,
    validated and written like any other delta's."""
    g = torch.Generator().manual_seed(3)
    bases = [torch.randn(1000 + 8 * i, generator=g).to(torch.bfloat16) for i in range(4)]
    news = [_changed(b, [i, 500, 999]) for i, b in enumerate(bases)]
    got = D.diff_many([(n, b, None) for n, b in zip(news, bases)], "xxh3")
    assert [k for k, _, _ in got] == [3, 3, 3, 3]
    storages = {d.blob.untyped_storage().data_ptr() for _, d, _ in got}
    assert len(storages) == (1 if path == "host" else 4)
    for (_, d, digest), new, base in zip(got, news, bases):
        assert d.blob.is_contiguous() and digest == checksum(D.bits(new).view(torch.uint8))
        meta = _planned(d)
        validate([meta], [BucketMeta(index=0, nbytes=meta.nbytes)])
        out = base.clone()
        D.write(out, d.blob.clone(), meta)
        assert _same_bits(out, new)
