"""The device checksum (torch integer ops, the same digest on every device) and the choice of algorithm."""

from __future__ import annotations

import pytest
import torch

from rlbus.transfer import checksum
from rlbus.transfer.checksum import CHUNK_WORDS, checksum_kind, device_checksum
from rlbus.transfer.stream import group_checksum_kind


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# past one chunk, a partial chunk and a partial last word
BUF = _bytes(2 * CHUNK_WORDS * 8 + 5 * 8 + 3)


def test_the_device_checksum_is_128_bits_of_hex_and_deterministic():
    h = device_checksum(BUF)
    assert len(h) == 32 and not h.strip("0123456789abcdef")
    assert device_checksum(BUF.clone()) == h
    assert checksum(BUF, "device") == h and checksum(BUF, "xxh3") != h


@pytest.mark.parametrize("where", [0, 7, 8, CHUNK_WORDS * 8 - 1, CHUNK_WORDS * 8, BUF.numel() - 1])
@pytest.mark.parametrize("bit", [0, 7])
def test_a_flipped_bit_anywhere_changes_both_halves(where, bit):
    h = device_checksum(BUF)
    bad = BUF.clone()
    bad[where] ^= 1 << bit
    g = device_checksum(bad)
    assert g[:16] != h[:16] and g[16:] != h[16:]


def test_the_top_bits_of_two_words_flipped_together_are_caught():
    # the blind spot of a sum of words times odd keys (2^63 * (odd + odd) = 0 mod 2^64)
    bad = BUF.clone()
    bad[7] ^= 0x80
    bad[15 + 8 * 1000] ^= 0x80
    assert device_checksum(bad) != device_checksum(BUF)


def test_truncation_and_zero_padding_are_caught():
    assert device_checksum(BUF[:-1]) != device_checksum(BUF)
    zeros = torch.zeros(4096, dtype=torch.uint8)
    lengths = {device_checksum(zeros[:n]) for n in (0, 1, 7, 8, 9, 4095, 4096)}
    assert len(lengths) == 7, "zeros of every length hash apart"


def test_words_and_chunks_swapped_in_place_are_caught():
    h = device_checksum(BUF)
    words = BUF[: 2 * CHUNK_WORDS * 8].view(torch.int64)
    swapped = BUF.clone()
    w = swapped[: 2 * CHUNK_WORDS * 8].view(torch.int64)
    w[3], w[4] = words[4], words[3]
    assert device_checksum(swapped) != h
    chunks = BUF.clone()
    c = chunks[: 2 * CHUNK_WORDS * 8].view(2, -1)
    c[[0, 1]] = c[[1, 0]].clone()
    assert device_checksum(chunks) != h


def test_a_bucket_in_another_buckets_place_does_not_match_even_with_the_same_bytes():
    same = torch.zeros(1 << 12, dtype=torch.uint8)
    assert checksum(same, "device", seed=0) != checksum(same, "device", seed=1)
    assert checksum(same, "xxh3", seed=0) == checksum(same, "xxh3", seed=1), "xxh3 stays unseeded"


def test_a_misaligned_view_hashes_like_its_aligned_copy():
    assert device_checksum(BUF[1:1001]) == device_checksum(BUF[1:1001].clone())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_checksum_on_cuda_equals_the_host_one():
    assert device_checksum(BUF.cuda()) == device_checksum(BUF)


def test_the_environment_forces_the_algorithm_and_nccl_defaults_to_the_device(monkeypatch):
    monkeypatch.delenv("RLBUS_CHECKSUM", raising=False)
    assert checksum_kind("nccl") == "device" and checksum_kind("gloo") == checksum_kind("shm") == "xxh3"
    assert checksum_kind() == "xxh3"
    monkeypatch.setenv("RLBUS_CHECKSUM", "device")
    assert checksum_kind("gloo") == checksum_kind() == "device"
    from rlbus.transfer import trainer_transfer, worker_transfer

    assert group_checksum_kind(trainer_transfer("gloo")) == group_checksum_kind(worker_transfer("shm")) == "device"
    assert checksum(BUF) == device_checksum(BUF), "the default follows the environment"
    monkeypatch.setenv("RLBUS_CHECKSUM", "md5")
    with pytest.raises(ValueError, match="RLBUS_CHECKSUM"):
        checksum_kind("gloo")


def test_the_xxh3_stream_compiled_code_feeds_equals_the_wheels_digest_however_it_is_sliced():
    """The delta scan feeds xxHash's streaming state from numba, a slice at a time: the digest it
    takes must be the one every worker computes with the wheel's Python API."""
    import numpy as np
    import xxhash

    from rlbus.transfer.checksum import native_stream

    stream = native_stream()
    assert stream is not None, "the pinned xxhash wheel exports xxHash's C API (else every delta is read twice)"
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 37, dtype=np.uint8)
    for n in (0, 1, 17, 240, 241, 4096, data.size):
        for step in (7, 100_003, max(n, 1)):
            state = stream.reset()
            for s in range(0, n, step):
                part = data[s : min(n, s + step)]
                stream.update(state, part.ctypes.data, part.size)
            assert stream.hexdigest() == xxhash.xxh3_128_hexdigest(data[:n].tobytes()), (n, step)
