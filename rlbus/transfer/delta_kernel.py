"""The compiled heart of a host delta: two slices of 8-byte words compared, and the changed
elements' positions and new bits written out.

numpy needs a pass for the compare, another to find the set mask entries, gathers for the
words and a split of their lanes (measured at 256 MiB bf16, 1.1 % changed: 0.21 s against
0.04 s to compare both copies once). The loop here never branches on the data while it streams
the two copies from memory: a data-dependent branch there (a word that changed, about one in
twenty at 1 % of bf16 elements changed) costs a misprediction that also throws away the loads
in flight, ~24 ns a changed word measured, 1.8x the bare read in all. So it works each piece
(PIECE words, which stay in the core's cache) in two passes. The first compares each group of
64 words into a 64-bit mask, branch-free (LLVM vectorizes it into vector compares and mask
moves), and lists the words whose bits are set, lowest first. The second writes each listed
word's changed lanes (same bits out, in the same order): in a piece where at most half the
words changed, only its changed lanes, found by their bits; in a denser one every lane,
branch-free, with the count moved by whether each changed.

Measured on a VM that reads ~30 GB/s (2026-12-06; 1 GiB bf16, one thread, best of eight): at
1.1 % of elements changed 119 ms, against 153 for the earlier first pass (a byte flag a word,
then blocks of 8 flags gathered) and ~70 to read both copies; at 0.2 %, 80 against 90. A
changed lane found by one carry into its highest bit rather than a loop folding its bits:
104-106 against 112-114 ms (1.1 %, one thread, alternated; on two threads, which the memory
bounds, 69 against 71-73).

Compiled by numba (a well-kept JIT for exactly such loops; hand-written C would need a
compiler on every host) on first use and cached on disk (``cache=True``): a process pays
numba's import (~1.4 s) and the cache load once, on its first delta, not per push.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

GROUP = 64
"""Words compared into one 64-bit mask: bit j set when word j of the group changed."""


PIECE = 1 << 15
"""Words worked at a time: the compare of the piece, then its flagged words' lanes, while both
copies' pieces (256 KiB each) and the list of flagged words stay in the core's cache."""


def scratch(words: int) -> np.ndarray:
    """The list of flagged words for :func:`changed_lanes` in pieces of ``words`` words (one
    place a word). Reused from call to call."""
    return np.empty(max(1, words), dtype=np.int64)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _flagged(new: np.ndarray, old: np.ndarray, words: np.ndarray) -> int:
    """The places of the words that differ between ``new`` and ``old`` (one piece), ascending,
    into ``words``; returns how many. Each group of GROUP words is compared into a 64-bit mask
    (the streaming compare, which LLVM vectorizes into vector compares and mask moves: no
    branch on the data), then its set bits are taken lowest first (their trailing zeros)."""
    n = new.size
    full = n // GROUP * GROUP
    m = 0
    for base in range(0, full, GROUP):
        mask = np.uint64(0)
        for j in range(GROUP):
            mask |= np.uint64(new[base + j] != old[base + j]) << np.uint64(j)
        while mask:
            words[m] = base + np.int64(trailing_zeros(mask))
            m += 1
            mask &= mask - np.uint64(1)
    for i in range(full, n):
        words[m] = i
        m += new[i] != old[i]
    return m


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
    words: np.ndarray,
) -> int:
    """Compare two int64 word slices (``new``, ``old``: the same length, word ``first_word`` of
    their tensors on), each word ``lanes`` elements of ``64 / lanes`` bits, little-endian.
    Every element whose bits differ is appended at ``k``: its flat position (int32) to
    ``positions``, its new bits to ``values`` (the unsigned type of its width), in ascending
    order. Returns the new count, or -1 once it passes ``limit``. Both outputs hold at least
    ``limit + lanes`` entries: a flagged word's lanes are all written, and the count moves by
    whether each changed. ``words`` comes from :func:`scratch`: the slice is worked in pieces
    of ``words.size`` words, each while it stays in the core's cache.

    A piece where at most half the words changed (an RL step's delta: ~4 % of bf16 words at
    1 % of elements) writes only the changed lanes, found by their bits (a flagged word's
    changed lanes are usually one, so the loop over them is predicted); a denser piece writes
    every lane of a flagged word, branch-free. 256 MiB of bf16 at 1.1 % changed: 37.7 ms against
    42.8 with every lane written (15 %: 145 against 156; 30 %: 262 against 222, hence the
    switch)."""
    width = 64 // lanes
    mask = (1 << width) - 1 if lanes > 1 else -1
    low = 0  # the lowest bit of every lane
    for j in range(lanes):
        low |= 1 << (width * j)
    highs = np.uint64(low << (width - 1))  # the highest bit of every lane
    rest = ~highs  # every lane's other bits
    shift = np.int64(trailing_zeros(np.uint64(width)))  # a lane's index from its lowest bit's
    piece = words.size
    for s in range(0, new.size, piece):
        e = min(s + piece, new.size)
        m = _flagged(new[s:e], old[s:e], words)
        if 2 * m <= e - s:
            for q in range(m):
                i = s + words[q]
                x = new[i]
                d = np.uint64(x ^ old[i])
                # a lane's highest bit set when any of its bits differ: its other bits plus all
                # ones there carry into it (no lane carries into the next), or it differed itself
                changed = (((d & rest) + rest) | d) & highs
                p = (first_word + i) * lanes
                while changed:
                    lane = np.int64(trailing_zeros(changed)) >> shift
                    positions[k] = p + lane
                    values[k] = (x >> (width * lane)) & mask
                    k += 1
                    changed &= changed - np.uint64(1)
                if k > limit:
                    return -1
        else:
            for q in range(m):
                i = s + words[q]
                x = new[i]
                d = x ^ old[i]
                p = (first_word + i) * lanes
                for j in range(lanes):
                    positions[k] = p + j
                    values[k] = (x >> (width * j)) & mask
                    k += ((d >> (width * j)) & mask) != 0
                if k > limit:
                    return -1
    return k


@numba.njit(cache=True, nogil=True, boundscheck=False)
def scatter(dst: np.ndarray, where: np.ndarray, values: np.ndarray) -> None:
    """``dst[where[i]] = values[i]`` for every i: an int32 delta written onto its base (the
    positions checked by the caller). numpy's fancy assignment takes ~24 ns an element here and
    holds the GIL throughout (1 GiB bf16 at 1.15 % changed: 0.14 s); this loop ~16 ns, with
    the GIL released (0.095 s: the rest is the cache lines it must read to write one element)."""
    for i in range(where.size):
        dst[where[i]] = values[i]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def scan(
    new: np.ndarray,
    old: np.ndarray,
    lanes: int,
    positions: np.ndarray,
    values: np.ndarray,
    limit: int,
    words: np.ndarray,
    step: int,
    update,
    state: int,
    base: np.ndarray,
    upos: np.ndarray,
    uval: np.ndarray,
) -> int:
    """A whole tensor's compare in one call (so the GIL is released once, not per slice): per
    ``step`` words, the last commit's delta entries (``upos``, ascending, and ``uval``) that
    fall in the slice written onto ``base`` (``old``'s lanes, so ``old`` holds them when it is
    read), the new slice fed to the xxh3 ``state`` through ``update`` (the ctypes function of
    checksum.NativeXxh3; ``state`` 0: no hash) and :func:`changed_lanes` run over it. Returns
    the count, or -1 once it passes ``limit``; every entry of the delta is written onto
    ``base`` either way."""
    k = 0
    q = 0
    for s in range(0, new.size, step):
        e = min(s + step, new.size)
        end = e * lanes
        while q < upos.size and upos[q] < end:
            base[upos[q]] = uval[q]
            q += 1
        if state:
            update(state, new[s:e].ctypes.data, (e - s) * 8)
        k = changed_lanes(new[s:e], old[s:e], lanes, s, positions, values, k, limit, words)
        if k < 0:
            break
    while q < upos.size:  # stopped early: the rest of the commit's delta
        base[upos[q]] = uval[q]
        q += 1
    return k


@intrinsic
def _at(typingctx, address):  # type: ignore[no-untyped-def]
    """An integer address as a pointer, for ``numba.carray`` (the tensors of one call are
    handed over as their addresses: a list of arrays would be boxed one by one)."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return sig, codegen


VALUES_ALIGN = 8
"""A blob's values start this aligned after its positions (buckets.VALUES_ALIGN; the next blob too)."""


@numba.njit(cache=True, nogil=True, boundscheck=False)
def scan_many(
    new_at: np.ndarray,
    old_at: np.ndarray,
    nwords: np.ndarray,
    lanes: int,
    limits: np.ndarray,
    under_pos_at: np.ndarray,
    under_val_at: np.ndarray,
    under_n: np.ndarray,
    out: np.ndarray,
    first: int,
    counts: np.ndarray,
    offsets: np.ndarray,
    values: np.ndarray,
    words: np.ndarray,
    step: int,
    update,
    reset,
    states: np.ndarray,
) -> int:
    """:func:`scan` over many tensors of one element width in one call, from tensor ``first``
    on: each one's int32 delta blob (positions, zeros to VALUES_ALIGN, values) written into
    ``out``, one after the other (8-aligned), so one call per compare thread and group releases
    the GIL once, where a call per tensor took it back ~500 times a push.

    Tensor i: ``nwords[i]`` 8-byte words at addresses ``new_at[i]`` / ``old_at[i]``; its last
    commit's int32 delta (``under_n[i]`` entries at ``under_pos_at[i]`` / ``under_val_at[i]``,
    ascending) written onto the old copy a slice ahead of the compare, all of it whatever
    happens; its xxh3 fed to state ``states[i]`` (0: not hashed; ``reset`` then ``update``, the
    ctypes functions of checksum.NativeXxh3). ``counts[i]``: how many elements changed, or -1
    when more than ``limits[i]`` did (nothing written to ``out``); ``offsets[i]``: where its
    blob starts. ``values``: scratch for at least max(limits) + lanes values.

    Stops before a tensor whose most room (``limits[i]`` positions and values) ``out`` no longer
    has; returns the first tensor not done."""
    itemsize = 8 // lanes
    base = out.ctypes.data
    at = 0
    for i in range(first, new_at.size):
        n = nwords[i]
        room = min(limits[i], n * lanes)
        slots = room + lanes  # a flagged word's lanes are written before the count keeps them
        most = (4 * slots + VALUES_ALIGN - 1) // VALUES_ALIGN * VALUES_ALIGN + slots * itemsize
        if out.size - at < most:
            return i
        new = numba.carray(_at(new_at[i]), n, np.int64)
        old = numba.carray(_at(old_at[i]), n, np.int64)
        elems = numba.carray(_at(old_at[i]), n * lanes, values.dtype)
        positions = numba.carray(_at(base + at), slots, np.int32)
        upos = numba.carray(_at(under_pos_at[i]), under_n[i], np.int32)
        uval = numba.carray(_at(under_val_at[i]), under_n[i], values.dtype)
        if states[i]:
            reset(states[i])
        k = scan(new, old, lanes, positions, values, room, words, step, update, states[i], elems, upos, uval)
        offsets[i] = at
        if k < 0 or k > limits[i]:
            counts[i] = -1
            continue
        counts[i] = k
        voff = (4 * k + VALUES_ALIGN - 1) // VALUES_ALIGN * VALUES_ALIGN
        for j in range(at + 4 * k, at + voff):
            out[j] = 0
        dst = numba.carray(_at(base + at + voff), k, values.dtype)
        for j in range(k):
            dst[j] = values[j]
        at = (at + voff + k * itemsize + 7) // 8 * 8
    return new_at.size
