"""The buffers a delta encode writes its blobs into (rlbus/transfer/arena.py): lent again only
once every blob written into them is gone, and what the free ones keep resident is bounded."""

from __future__ import annotations

import gc

import torch

from rlbus.transfer import arena as A
from rlbus.transfer import delta as D


def test_a_buffer_is_lent_again_only_once_every_view_of_it_is_gone():
    arena = A.Arena()
    out = arena.lend(1000)
    first = out.data_ptr()
    blob = out[10:20].view(torch.int16)  # a delta's blob: a view of what was lent
    del out
    assert arena.lend(1000).data_ptr() != first, "a blob of it lives: another buffer"
    del blob
    gc.collect()
    again = arena.lend(1000)
    assert again.data_ptr() == first and len(arena) == 2, "its blobs gone: lent again, pages in place"


def test_the_smallest_free_buffer_that_fits_is_lent_and_a_bigger_ask_gets_a_new_one():
    arena = A.Arena()
    small, big = arena.lend(A.MIN_BYTES), arena.lend(4 * A.MIN_BYTES)
    at_small, at_big = small.data_ptr(), big.data_ptr()
    del small, big
    assert arena.lend(100).data_ptr() == at_small
    huge = arena.lend(8 * A.MIN_BYTES)
    assert huge.data_ptr() not in (at_small, at_big) and huge.numel() == 8 * A.MIN_BYTES and len(arena) == 3


def test_free_buffers_written_past_the_bound_are_let_go_the_furthest_written_first():
    arena = A.Arena(keep_bytes=A.MIN_BYTES)
    lent = [arena.lend(A.MIN_BYTES) for _ in range(3)]
    for out, written in zip(lent, (A.MIN_BYTES // 4, A.MIN_BYTES, A.MIN_BYTES // 2)):
        arena.wrote(out, written)
    kept = {lent[0].data_ptr(), lent[2].data_ptr()}
    del lent, out
    arena.lend(10)  # a lend trims what the free ones hold: 1/2 + 1 over the bound, the 1 goes
    assert len(arena) == 2
    one, two = arena.lend(10), arena.lend(10)
    assert {one.data_ptr(), two.data_ptr()} == kept


def test_an_encode_never_writes_into_the_blobs_of_the_last_one_while_they_live():
    """The last push's blobs are the trainer's snapshot until the next commit: the next encode
    (the same compare thread, the same arena) writes elsewhere, and its own blobs decode."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(50_000, generator=g).to(torch.bfloat16)
    first = base.clone()
    first.view(torch.int16)[::97] ^= 1
    second = base.clone()
    second.view(torch.int16)[3::89] ^= 1
    ((k1, d1, _),) = D.diff_many([(first, base, None)], "xxh3")
    kept = d1.blob.clone()
    ((k2, d2, _),) = D.diff_many([(second, base, None)], "xxh3")
    assert k1 and k2 and d1.blob.equal(kept), "the first blobs untouched"
    for d, new in ((d1, first), (d2, second)):
        out = base.clone()
        d.apply_to(out)
        assert out.view(torch.int16).equal(new.view(torch.int16))
    at = d1.blob.untyped_storage().data_ptr()
    del d1
    gc.collect()
    ((_, d3, _),) = D.diff_many([(second, base, None)], "xxh3")
    assert d3.blob.untyped_storage().data_ptr() == at, "its blobs gone: the first buffer again"
