"""The compiled heart of a host delta: one pass over two slices of 8-byte words that writes the
changed elements' positions and new bits where they are found.

numpy needs a pass for the compare, another to find the set mask entries, gathers for the
words and a split of their lanes (measured at 256 MiB bf16, 1.1 % changed: 0.21 s against
0.04 s to compare both copies once); this loop reads each word of both copies once and
touches the output only for a change (0.07 s). Compiled by numba (a well-kept JIT for exactly
such loops; hand-written C would need a compiler on every host) on first use and cached on
disk (``cache=True``): a process pays numba's import (~1.4 s) and the cache load once, on its
first delta, not per push.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, boundscheck=False)
def changed_lanes(
    new: np.ndarray,
    old: np.ndarray,
    lanes: int,
    first_word: int,
    positions: np.ndarray,
    values: np.ndarray,
    k: int,
    limit: int,
) -> int:
    """Compare two int64 word slices (``new``, ``old``: the same length, word ``first_word`` of
    their tensors on), each word ``lanes`` elements of ``64 / lanes`` bits, little-endian.
    Every element whose bits differ is appended at ``k``: its flat position (int32) to
    ``positions``, its new bits to ``values`` (the unsigned type of its width). Returns the
    new count, or -1 once it would pass ``limit`` (both outputs hold at least ``limit``)."""
    width = 64 // lanes
    mask = (1 << width) - 1 if lanes > 1 else -1
    for i in range(new.size):
        x = new[i]
        y = old[i]
        if x == y:
            continue
        if lanes == 1:
            if k >= limit:
                return -1
            positions[k] = first_word + i
            values[k] = x
            k += 1
            continue
        for j in range(lanes):
            nv = (x >> (width * j)) & mask
            if nv != ((y >> (width * j)) & mask):
                if k >= limit:
                    return -1
                positions[k] = (first_word + i) * lanes + j
                values[k] = nv
                k += 1
    return k
