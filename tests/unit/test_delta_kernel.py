"""The host delta's compiled kernel (rlbus.transfer.delta_kernel) against numpy's element-wise
compare: every changed lane listed once, in order, with its new bits, across piece boundaries and
64-word groups, at every lane width and density (a piece with few changed words and one with
many take different paths), and refused past the room it was given without writing beyond it."""

from __future__ import annotations

import numpy as np
import pytest

from rlbus.transfer.delta_kernel import changed_lanes, scatter, scratch

LANE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("numel_words", [1, 7, 8, 9, 4099])
@pytest.mark.parametrize("piece", [3, 16, 200, None], ids=["piece3", "piece16", "piece200", "one-piece"])
@pytest.mark.parametrize("density", [0.01, 0.15, 0.6])  # sparse pieces, both kinds, dense pieces
def test_the_kernel_lists_every_changed_lane_in_order_with_its_new_bits(itemsize, numel_words, piece, density):
    lanes, lane_t = 8 // itemsize, LANE[itemsize]
    rng = np.random.default_rng(numel_words * 10 + itemsize)
    old = rng.integers(-(2**62), 2**62, size=numel_words, dtype=np.int64)
    new = old.copy()
    lane_view = new.view(lane_t)
    hit = rng.random(lane_view.size) < density
    hit[0] = hit[-1] = True  # the first and the last lane too
    top, low = lane_t(1 << (8 * itemsize - 1)), lane_t(1)  # the sign bit (signed lanes), the lowest
    lane_view[hit] ^= np.where(rng.random(lane_view.size) < 0.5, top, low)[hit]
    want = np.flatnonzero(new.view(lane_t) != old.view(lane_t))
    first = 1000  # the slice's first word in its tensor
    positions = np.empty(want.size + lanes, dtype=np.int32)
    values = np.empty(want.size + lanes, dtype=lane_t)
    k = changed_lanes(new, old, lanes, first, positions, values, 0, want.size, scratch(piece or numel_words))
    assert k == want.size
    assert positions[:k].tolist() == (want + first * lanes).tolist()
    assert values[:k].tolist() == new.view(lane_t)[want].tolist()
    # one fewer allowed: refused, and nothing written past the room it was given
    room = want.size - 1 + lanes
    short = np.full(room + 8, -7, dtype=np.int32)
    k = changed_lanes(new, old, lanes, first, short, values, 0, want.size - 1, scratch(piece or numel_words))
    assert k == -1 and (short[room:] == -7).all()


def test_the_scatter_writes_every_value_at_its_position_and_nothing_else():
    dst = np.arange(100, dtype=np.uint16)
    where = np.array([0, 3, 50, 99], dtype=np.int32)
    values = np.array([7, 8, 9, 10], dtype=np.uint16)
    want = dst.copy()
    want[where] = values
    scatter(dst, where, values)
    assert dst.tolist() == want.tolist()
