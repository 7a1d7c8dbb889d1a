"""Delta encoding: only the elements of a tensor whose bits changed since a base.

Elements are compared as bits (the tensor viewed as an integer dtype of its width), never as
floats: NaN equals its own bits, -0.0 differs from 0.0. A delta is one block of bytes:

    [index block][pad to 8][values]

* index ``int32``: the changed flat indices, ascending (4 bytes each);
* index ``bitmap``: ceil(numel / 8) bytes, bit j of byte i set for element 8i + j;
* values: the new elements in the tensor's own dtype, in index order.

:func:`encode` says "dense" when neither beats the tensor's own bytes, and otherwise takes
int32 indices while they beat dense (bf16: 6 bytes a changed element against 2 an element,
so up to ~1/3 changed), the bitmap beyond (numel/8 + 2 bytes a changed one, up to ~15/16):
by bytes alone the bitmap wins from ~3%, but decoding it reads every element (see
:func:`choose`). The layout sizes live in buckets.py (validate checks them).

Where it runs: on the tensor's device. A GPU tensor is compared, encoded (its int32 delta's
blob built in GPU memory, ready for an NCCL bucket) and applied with torch ops there
(:func:`_diff_torch`, :func:`write`); its base may be on the same GPU or in pinned host memory
(then each chunk of the base is copied up as it is compared). A host tensor is compared by
a compiled loop a cache-sized slice at a time (:func:`_scan`), which beats torch's kernels on CPU;
``RLBUS_DELTA=device`` runs the torch path on the host too (so CI exercises it).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

import msgspec
import numpy as np  # matplotlib's dependency, so always there; its 1-D integer kernels beat torch's here
import torch

from rlbus.schemas import DeltaIndex, ParamMeta
from rlbus.transfer.arena import Arena
from rlbus.transfer.base import PlanError
from rlbus.transfer.buckets import (
    VALUES_ALIGN,
    align_up,
    delta_index_nbytes,
    delta_layout_problem,
    dtype_name,
    torch_dtype,
)
from rlbus.transfer.checksum import ChecksumKind, NativeXxh3, checksum, checksum_kind

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22
"""Elements (or 8-byte words) compared at a time, into a reused mask (a multiple of 8)."""


class DeltaError(PlanError):
    """A delta's bytes do not decode (indices out of range or unordered, a bitmap's count wrong)."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """A flat view of ``t``'s elements as integers of the same width (no copy; t contiguous)."""
    flat = t.detach().reshape(-1)
    return flat.view(_BITS[t.element_size()])


class _Scratch(threading.local):
    """Per-thread reusable masks: a fresh multi-MiB tensor per compare costs page faults that
    take longer than the compare itself (measured: 94 -> 57 ms for 64 M bf16 elements)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.bool)

    def bools(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=torch.bool)
        return self.buf[:n]


_scratch = _Scratch()


@dataclass(frozen=True)
class Delta:
    """One tensor's changed elements, encoded (what travels, and what the trainer keeps until
    the commit to bring its snapshot along)."""

    index: DeltaIndex
    changed: int
    blob: torch.Tensor
    """uint8: index block, padding, values."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    def meta(self, planned: ParamMeta) -> ParamMeta:
        """The wire metadata of this delta, from the planned (uint8) meta of its blob."""
        inb = delta_index_nbytes(self.index, self.changed, math.prod(self.shape))
        return msgspec.structs.replace(
            planned,
            dtype=dtype_name(self.dtype),
            shape=list(self.shape),
            encoding="delta",
            index=self.index,
            changed=self.changed,
            index_nbytes=inb,
            values_offset=align_up(inb, VALUES_ALIGN),
        )

    def apply_to(self, out: torch.Tensor) -> None:
        """Write this delta onto ``out`` (the base it was taken against)."""
        if self.changed:
            n = self.blob.numel()
            write(out, self.blob, self.meta(ParamMeta(name="", dtype="uint8", shape=[n], bucket=0, offset=0, nbytes=n)))

    def parts(self) -> tuple[np.ndarray, np.ndarray]:
        """An int32 delta's (ascending positions, new bits as unsigned integers), views of its blob."""
        assert self.index == "int32"
        raw = self.blob.numpy()
        voff = align_up(4 * self.changed, VALUES_ALIGN)
        return raw[: 4 * self.changed].view(np.int32), raw[voff:].view(_UINT[self.dtype.itemsize])


def sizes(changed: int, numel: int, itemsize: int) -> dict[str, int]:
    """Bytes each way of sending a tensor with ``changed`` of ``numel`` elements changed."""
    values = changed * itemsize
    fits = numel <= 2**31  # int32 indices name elements 0..2^31-1
    return {
        "int32": align_up(delta_index_nbytes("int32", changed, numel), VALUES_ALIGN) + values if fits else 1 << 62,
        "bitmap": align_up(delta_index_nbytes("bitmap", changed, numel), VALUES_ALIGN) + values,
        "dense": numel * itemsize,
    }


def choose(cost: dict[str, int]) -> DeltaIndex:
    """int32 indices whenever they beat dense, the bitmap only where they do not (and it does).

    By bytes alone the bitmap wins from ~3% changed (bf16); but applying it reads every
    element's bit, where indices touch only the changed ones: measured on 2 cores, writing a
    7%-changed bf16 delta takes ~1 s/GiB from a bitmap and ~60 ms/GiB from indices, while the
    indices' extra bytes cost ~40 ms/GiB on the loopback wire. So indices up to ~1/3 changed
    (int32 + bf16: 6 bytes against 2 a dense element), the bitmap from there to ~15/16."""
    return "int32" if cost["int32"] < cost["dense"] or cost["int32"] <= cost["bitmap"] else "bitmap"


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Ascending int64 flat indices of the elements whose bits differ (same dtype and shape)."""
    a, b = _pair(new, base)
    return _element_positions(a, b)


DEVICE_ENV = "RLBUS_DELTA"
"""``device``: compare, encode and apply host tensors with the torch code GPU tensors use."""


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s delta takes the torch (device) path: off the host, or forced there."""
    return t.device.type != "cpu" or os.environ.get(DEVICE_ENV, "").strip().lower() == "device"


def diff(new: torch.Tensor, base: torch.Tensor) -> tuple[int, Delta | None]:
    """How many elements of ``new`` differ from ``base`` in their bits, and the delta in the
    form :func:`choose` picks (None when dense is no bigger). Nothing changed: (0, an empty
    Delta). On the host, numpy compares 8-byte words a cache-sized slice at a time (see
    :func:`_scan`); elsewhere, torch on the tensor's device (:func:`_diff_torch`)."""
    a, b = _pair(new, base)
    shape, dtype = tuple(new.shape), new.dtype
    if on_device(a):
        return _diff_torch(a, b, shape, dtype)
    found = _scan(a, b, _int32_limit(a.numel(), a.element_size()))
    if found is not None:
        return _finish(a, found, shape, dtype)
    return _diff(a, b, shape, dtype)


DEVICE_CHUNK = 1 << 24
"""Elements compared at a time by :func:`_diff_torch` off the host (a 16 MiB mask)."""


def _part(b: torch.Tensor, s: int, e: int, device: torch.device) -> torch.Tensor:
    """``b[s:e]`` on ``device`` (a base in pinned host memory is copied up a chunk at a time)."""
    c = b[s:e]
    return c if c.device == device else c.to(device, non_blocking=True)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Delta:
    blob = torch.empty(0, dtype=torch.uint8, device=device)
    return Delta(index="int32", changed=0, blob=blob, shape=shape, dtype=dtype)


def _diff_torch(
    a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[int, Delta | None]:
    """The delta with torch ops on ``a``'s device, in one chunked pass over both copies: the
    elements' integer views compared, the changed positions (int32) and new bits gathered while
    the chunk is fresh, and an int32 delta's blob assembled on the device. More changed than
    int32 indices can beat: the general way (:func:`_diff`)."""
    numel, itemsize, dev = a.numel(), a.element_size(), a.device
    limit = _int32_limit(numel, itemsize)
    if numel > 2**31:
        return _diff(a, b, shape, dtype)
    step = DEVICE_CHUNK if dev.type != "cpu" else _CHUNK
    where: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    k = 0
    for s in range(0, numel, step):
        ca = a[s : s + step]
        hit = torch.nonzero(torch.ne(ca, _part(b, s, s + ca.numel(), dev))).squeeze(1)
        if not hit.numel():
            continue
        k += hit.numel()
        if k > limit:
            return _diff(a, b, shape, dtype)
        values.append(ca[hit])
        where.append(hit.add_(s).to(torch.int32))
    if k == 0:
        return 0, _empty(shape, dtype, dev)
    cost = sizes(k, numel, itemsize)
    index = choose(cost)
    if cost[index] >= cost["dense"]:
        return k, None
    if index != "int32":
        return k, _build(a, torch.cat(where).to(torch.int64), None, index, shape, dtype)
    inb = delta_index_nbytes("int32", k, numel)
    voff = align_up(inb, VALUES_ALIGN)
    blob = torch.empty(voff + k * itemsize, dtype=torch.uint8, device=dev)
    blob[inb:voff].zero_()
    torch.cat(where, out=blob[:inb].view(torch.int32))
    torch.cat(values, out=blob[voff:].view(a.dtype))
    return k, Delta(index="int32", changed=k, blob=blob, shape=shape, dtype=dtype)


def _diff(a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, Delta | None]:
    """The general way (a device tensor, bytes that are not whole words, or too many changed
    for int32 indices): count, then build the form :func:`choose` picks."""
    numel, itemsize = a.numel(), a.element_size()
    k = _count(a, b)
    if k == 0:
        return 0, _empty(shape, dtype, a.device)
    cost = sizes(k, numel, itemsize)
    index = choose(cost)
    if cost[index] >= cost["dense"]:
        return k, None
    if index == "int32":
        return k, _build(a, _element_positions(a, b), None, index, shape, dtype)
    return k, _build(a, None, b, index, shape, dtype, changed=k)


SCAN_WORDS = 1 << 17
"""8-byte words :func:`_scan`'s compiled pass works at a time (1 MiB of each copy): the new
slice is hashed while it is in the core's cache, and the last commit's delta is written onto
the base's slice just before it is read. The kernel compares it in pieces that stay in the
nearer cache (delta_kernel.PIECE)."""

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class _Found:
    """What :func:`_scan` found: the changed elements' ascending flat positions (int32) and
    new bits, in pieces."""

    changed: int
    positions: list[np.ndarray]
    values: list[np.ndarray]
    digest: str | None = None
    """The new bytes' xxh3-128, taken in the scan's pass (None: not asked for, or not at hand)."""
    blob: torch.Tensor | None = None
    """The int32 delta's blob, written already (:func:`diff_many`: positions and values are views of it)."""


def _words(t: torch.Tensor) -> np.ndarray | None:
    """The bytes of a flat contiguous host tensor as int64 words (None: not whole, aligned words)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes % 8 or t.data_ptr() % 8:
        return None
    return t.view(torch.uint8).view(torch.int64).numpy()


def _scan(
    a: torch.Tensor, b: torch.Tensor, limit: int, hashed: bool = False, under: Delta | None = None
) -> _Found | None:
    """The changed elements of ``a`` against ``b`` (flat bit views, one dtype, on the host), in
    one compiled pass over the tensor (delta_kernel.scan) that compares each 8-byte word once
    and writes a changed one's elements (position, new bits) where it finds them. ``hashed``:
    the new bytes' xxh3-128 is taken in the same pass, a slice at a time while it is in cache
    (:attr:`_Found.digest`; None where xxHash's C API is not at hand: the caller hashes in a
    second pass). None when the bytes are not whole words, there are 2^31 elements or more
    (int32 positions), or more than ``limit`` elements changed (the caller encodes another way).

    ``under``: an int32 delta not yet written onto ``b`` (the last commit's): each slice of
    ``b`` gets its part just before it is compared, while it is in cache. ``b`` holds all of
    it when this returns, whatever it returns (and if it raises)."""
    from rlbus.transfer.checksum import native_stream, native_update
    from rlbus.transfer.delta_kernel import PIECE, scan, scatter, scratch  # numba: on the first delta

    itemsize = a.element_size()
    wa, wb = _words(a), _words(b)
    if under is not None and (
        wa is None or wb is None or a.numel() > 2**31 or under.index != "int32" or under.blob.device.type != "cpu"
    ):
        under.apply_to(b)
        under = None
    if wa is None or wb is None or a.numel() > 2**31:
        return None
    lanes = 8 // itemsize
    lane_t = _UINT[itemsize]
    room = min(limit, a.numel())  # untouched pages cost nothing: only what is found is written
    positions = np.empty(room + lanes, dtype=np.int32)  # a word's lanes land before the count keeps them
    values = np.empty(room + lanes, dtype=lane_t)
    words = scratch(min(PIECE, wa.size))
    eb = wb.view(lane_t)
    if under is not None and under.changed:
        upos, uval = under.parts()
    else:
        upos, uval = np.empty(0, dtype=np.int32), np.empty(0, dtype=lane_t)
    stream = native_stream() if hashed else None
    try:
        k = scan(
            wa,
            wb,
            lanes,
            positions,
            values,
            room,
            words,
            SCAN_WORDS,
            stream.update if stream is not None else native_update(),
            stream.reset() if stream is not None else 0,
            eb,
            upos,
            uval,
        )
    except BaseException:  # before the kernel ran (its first compile, say): the delta lands all the same
        scatter(eb, upos, uval)
        raise
    if k < 0 or k > limit:
        return None
    return _Found(
        changed=k, positions=[positions[:k]], values=[values[:k]], digest=stream.hexdigest() if stream else None
    )


def _int32_limit(numel: int, itemsize: int) -> int:
    """The most changed elements for which :func:`choose` could still pick int32 indices."""
    return numel * itemsize // (4 + itemsize) + 2


def _blob(found: _Found, numel: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Delta:
    """The int32-indexed delta of what :func:`_scan` found, written straight into one blob."""
    if found.blob is not None:
        return Delta(index="int32", changed=found.changed, blob=found.blob, shape=shape, dtype=dtype)
    k, itemsize = found.changed, dtype.itemsize
    inb = delta_index_nbytes("int32", k, numel)
    voff = align_up(inb, VALUES_ALIGN)
    blob = torch.empty(voff + k * itemsize, dtype=torch.uint8)
    raw = blob.numpy()
    raw[inb:voff] = 0
    if k:
        np.concatenate(found.positions, out=raw[:inb].view(np.int32))
        np.concatenate(found.values, out=raw[voff:].view(_UINT[itemsize]))
    return Delta(index="int32", changed=k, blob=blob, shape=shape, dtype=dtype)


def diff_checked(
    new: torch.Tensor, base: torch.Tensor, under: Delta | None = None, kind: ChecksumKind | None = None
) -> tuple[int, Delta | None, str]:
    """:func:`diff`, and the checksum of ``new``'s bytes (``kind``: the group's algorithm, see
    :mod:`rlbus.transfer.checksum`; None: the default for ``new``'s device) when a delta of
    changed elements came out ("" otherwise: dense tensors are covered by their bucket's
    checksum). On the host an xxh3 hash is taken in the same pass as the compare, while each
    slice is in cache.

    ``under``: a delta to write onto ``base`` (contiguous) first, the last commit's: on the host
    it is written a slice at a time as the compare reaches it. ``base`` holds it afterwards."""
    if under is not None and not base.is_contiguous():
        raise PlanError("a delta is applied onto a contiguous tensor")
    try:
        a, b = _pair(new, base)
    except PlanError:
        if under is not None:
            under.apply_to(base)  # the caller handed it over: base holds it, whatever happens
        raise
    if kind is None:
        kind = "device" if a.device.type != "cpu" else checksum_kind()

    def digest(k: int, d: Delta | None) -> str:
        return checksum(a.view(torch.uint8), kind) if k and d is not None else ""

    if on_device(a):
        if under is not None:
            under.apply_to(base)
        k, d = _diff_torch(a, b, tuple(new.shape), new.dtype)
        return k, d, digest(k, d)
    found = _scan(a, b, _int32_limit(a.numel(), a.element_size()), kind == "xxh3", under)
    if found is not None:
        k, d = _finish(a, found, tuple(new.shape), new.dtype)
        if found.digest is not None:
            return k, d, found.digest if k and d is not None else ""
        return k, d, digest(k, d)
    k, d = _diff(a, b, tuple(new.shape), new.dtype)
    return k, d, digest(k, d)


BLOB_CHUNK = 16 << 20
"""Bytes of the buffer :func:`diff_many` writes blobs into (more where one tensor's most room needs it).
Pages it does not write are never touched; the blobs are views of it."""


class _Many(threading.local):
    """A compare thread's scratch for :func:`diff_many`, kept between calls: the xxh3 states
    (one a tensor of a call), the values scratch per element width, the kernel's word list, the
    blob buffers (rlbus.transfer.arena)."""

    def __init__(self) -> None:
        self.states: list[NativeXxh3] = []
        self.values: dict[int, np.ndarray] = {}
        self.words: np.ndarray | None = None
        self.arena = Arena()
        """The buffers its blobs are written into, reused once their blobs are gone."""

    def state_list(self, n: int, lib: NativeXxh3) -> list[NativeXxh3]:
        while len(self.states) < n:
            self.states.append(lib.fresh())
        return self.states[:n]

    def value_room(self, itemsize: int, n: int) -> np.ndarray:
        v = self.values.get(itemsize)
        if v is None or v.size < n:
            v = self.values[itemsize] = np.empty(max(n, 1 << 16), dtype=_UINT[itemsize])
        return v


_many = _Many()


def _whole_words(new: torch.Tensor, base: torch.Tensor, under: Delta | None) -> bool:
    """Whether :func:`diff_many` compares this pair in its compiled call: both on the host (and
    not forced onto the torch path, :func:`on_device`), one dtype and shape, contiguous, whole
    aligned 8-byte words, int32 positions, and an int32 host delta (if any) of its width."""
    if on_device(new) or base.device.type != "cpu" or new.dtype != base.dtype or new.shape != base.shape:
        return False
    if not (new.is_contiguous() and base.is_contiguous()) or new.numel() > 2**31:
        return False
    if (new.numel() * new.element_size()) % 8 or new.data_ptr() % 8 or base.data_ptr() % 8:
        return False
    return under is None or (
        under.index == "int32" and under.blob.device.type == "cpu" and under.dtype.itemsize == new.element_size()
    )


def diff_many(
    items: list[tuple[torch.Tensor, torch.Tensor, Delta | None]], kind: ChecksumKind
) -> list[tuple[int, Delta | None, str]]:
    """:func:`diff_checked` of many (new, base, under) at once. Host tensors of whole words,
    hashed with xxh3, go through one compiled call per element width (delta_kernel.scan_many:
    the GIL is released once, not once a tensor), their blobs written side by side into one
    buffer (each a view of it); the others one by one. Every ``under`` is written onto its base
    when this returns, whatever it returns (and if it raises)."""
    from rlbus.transfer.checksum import native_stream

    results: list[tuple[int, Delta | None, str] | None] = [None] * len(items)
    stream = native_stream() if kind == "xxh3" else None
    widths: dict[int, list[int]] = {}
    rest: list[int] = []
    for i, (new, base, under) in enumerate(items):
        if stream is not None and _whole_words(new, base, under):
            widths.setdefault(new.element_size(), []).append(i)
        else:
            rest.append(i)
    done: set[int] = set()  # compared, its under written
    try:
        for itemsize, idx in widths.items():
            assert stream is not None
            _diff_width(items, idx, itemsize, stream, results, done)
        for i in rest:
            results[i] = diff_checked(*items[i], kind)
            done.add(i)
    except BaseException:
        for i, (_, base, under) in enumerate(items):
            if i not in done and under is not None:
                try:
                    under.apply_to(base)  # writing a delta twice writes the same bits
                except Exception:  # a base it cannot go onto: the first error is the one to tell
                    pass
        raise
    return results  # type: ignore[return-value]


def _diff_width(
    items: list[tuple[torch.Tensor, torch.Tensor, Delta | None]],
    idx: list[int],
    itemsize: int,
    stream: NativeXxh3,
    results: list[tuple[int, Delta | None, str] | None],
    done: set[int],
) -> None:
    """:func:`diff_many`'s compiled call for the tensors ``idx`` (one element width)."""
    from rlbus.transfer.delta_kernel import PIECE, scan_many, scratch
    from rlbus.transfer.delta_kernel import VALUES_ALIGN as KERNEL_ALIGN

    assert KERNEL_ALIGN == VALUES_ALIGN
    n, lanes = len(idx), 8 // itemsize
    new_at = np.empty(n, dtype=np.int64)
    old_at = np.empty(n, dtype=np.int64)
    nwords = np.empty(n, dtype=np.int64)
    limits = np.empty(n, dtype=np.int64)
    upos = np.zeros(n, dtype=np.int64)
    uval = np.zeros(n, dtype=np.int64)
    un = np.zeros(n, dtype=np.int64)
    most = np.empty(n, dtype=np.int64)
    for j, i in enumerate(idx):
        new, base, under = items[i]
        numel = new.numel()
        new_at[j], old_at[j], nwords[j] = new.data_ptr(), base.data_ptr(), numel * itemsize // 8
        limits[j] = _int32_limit(numel, itemsize)
        slots = min(int(limits[j]), numel) + lanes
        most[j] = align_up(4 * slots, VALUES_ALIGN) + slots * itemsize
        if under is not None and under.changed:
            upos[j] = under.blob.data_ptr()
            uval[j] = upos[j] + align_up(4 * under.changed, VALUES_ALIGN)
            un[j] = under.changed
    states = _many.state_list(n, stream)
    addresses = np.array([s.state for s in states], dtype=np.int64)
    values = _many.value_room(itemsize, int(np.minimum(limits, nwords * lanes).max(initial=0)) + lanes)
    if _many.words is None:
        _many.words = scratch(PIECE)
    counts = np.zeros(n, dtype=np.int64)
    offsets = np.zeros(n, dtype=np.int64)
    first = 0
    while first < n:
        cap = int(min(most[first:].sum(), max(BLOB_CHUNK, most[first])))
        out = _many.arena.lend(cap)
        stop = scan_many(
            new_at,
            old_at,
            nwords,
            lanes,
            limits,
            upos,
            uval,
            un,
            out.numpy(),
            first,
            counts,
            offsets,
            values,
            _many.words,
            SCAN_WORDS,
            stream.update,
            stream.reset_fn,
            addresses,
        )
        for j in range(first, stop):
            i = idx[j]
            done.add(i)
            results[i] = _kept(items[i], int(counts[j]), out, int(offsets[j]), states[j])
        # how far it wrote: a blob's end, or for one past its limit the positions it got to
        span = np.where(
            counts[first:stop] >= 0,
            4 * counts[first:stop] + 8 + counts[first:stop] * itemsize,
            4 * (limits[first:stop] + lanes),
        )
        _many.arena.wrote(out, int((offsets[first:stop] + span).max(initial=0)))
        first = stop


def _kept(
    item: tuple[torch.Tensor, torch.Tensor, Delta | None], k: int, out: torch.Tensor, at: int, state: NativeXxh3
) -> tuple[int, Delta | None, str]:
    """The result of one tensor of :func:`scan_many`: its int32 blob in ``out`` at ``at`` (``k``
    changed) in the form :func:`_finish` picks, or, more changed than int32 positions allow
    (-1), the general way."""
    new, base = item[0], item[1]
    shape, dtype, itemsize = tuple(new.shape), new.dtype, new.element_size()
    if k < 0:
        a = bits(new)
        k, d = _diff(a, bits(base), shape, dtype)
        return k, d, checksum(a.view(torch.uint8), "xxh3") if k and d is not None else ""
    voff = align_up(4 * k, VALUES_ALIGN)
    blob = out[at : at + voff + k * itemsize]
    raw = blob.numpy()
    found = _Found(k, [raw[: 4 * k].view(np.int32)], [raw[voff:].view(_UINT[itemsize])], blob=blob)
    k, d = _finish(new, found, shape, dtype)
    return k, d, state.hexdigest() if k and d is not None else ""


def _finish(new: torch.Tensor, found: _Found, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, Delta | None]:
    """The delta of a scan's result in the form :func:`choose` picks."""
    numel, itemsize, k = new.numel(), new.element_size(), found.changed
    if k == 0:
        return 0, Delta(index="int32", changed=0, blob=torch.empty(0, dtype=torch.uint8), shape=shape, dtype=dtype)
    cost = sizes(k, numel, itemsize)
    index = choose(cost)
    if cost[index] >= cost["dense"]:
        return k, None
    if index == "int32":
        return k, _blob(found, numel, dtype, shape)
    pos = torch.from_numpy(np.concatenate(found.positions).astype(np.int64))
    return k, _build(bits(new), pos, None, index, shape, dtype)


def _count(a: torch.Tensor, b: torch.Tensor) -> int:
    k = 0
    for s in range(0, a.numel(), _CHUNK):
        m = _scratch.bools(min(_CHUNK, a.numel() - s)) if a.device.type == "cpu" else None
        k += int(torch.count_nonzero(torch.ne(a[s : s + _CHUNK], _part(b, s, s + _CHUNK, a.device), out=m)))
    return k


def _element_positions(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cpu" and b.device.type == "cpu":
        na, nb = a.numpy(), b.numpy()
        mask = _scratch.bools(min(_CHUNK, na.size)).numpy()
        found = []
        for s in range(0, na.size, _CHUNK):
            m = mask[: min(_CHUNK, na.size - s)]
            np.not_equal(na[s : s + _CHUNK], nb[s : s + _CHUNK], out=m)
            hit = np.flatnonzero(m)
            if hit.size:
                found.append(hit + s)
        return torch.from_numpy(np.concatenate(found)) if found else torch.empty(0, dtype=torch.int64)
    parts = []
    for s in range(0, a.numel(), _CHUNK):
        hit = torch.nonzero(a[s : s + _CHUNK] != _part(b, s, s + _CHUNK, a.device)).squeeze(1)  # type: ignore[assignment]
        if hit.numel():  # type: ignore[attr-defined]
            parts.append(hit + s)
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=a.device)  # type: ignore[arg-type]


def _pair(new: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as flat integer views; the base on the tensor's device or on the host (pinned
    memory a device tensor's compare copies up a chunk at a time)."""
    if new.dtype != base.dtype or new.shape != base.shape:
        raise PlanError(f"delta base is {base.dtype}{list(base.shape)}, the tensor {new.dtype}{list(new.shape)}")
    if new.device != base.device and base.device.type != "cpu":
        raise PlanError(f"delta base is on {base.device}, the tensor on {new.device}")
    return bits(new.contiguous()), bits(base.contiguous())


def _build(
    a: torch.Tensor,
    pos: torch.Tensor | None,
    b: torch.Tensor | None,
    index: DeltaIndex,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    changed: int | None = None,
) -> Delta:
    """The blob (on ``a``'s device): from positions, or (bitmap) from the element masks of a vs b."""
    numel, itemsize = a.numel(), a.element_size()
    k = pos.numel() if pos is not None else int(changed or 0)
    inb = delta_index_nbytes(index, k, numel)
    voff = align_up(inb, VALUES_ALIGN)
    blob = torch.empty(voff + k * itemsize, dtype=torch.uint8, device=a.device)
    blob[inb:voff].zero_()
    values = blob[voff:].view(a.dtype)
    if pos is not None:
        if index == "int32":
            blob[:inb].view(torch.int32).copy_(pos)
        else:
            blob[:inb].copy_(pack_bits(pos, numel))
        values.copy_(torch.index_select(a, 0, pos.to(a.device)))
    else:
        assert b is not None
        at = 0
        for s in range(0, numel, _CHUNK):  # _CHUNK is a multiple of 8: each chunk packs to whole bytes
            m = torch.ne(a[s : s + _CHUNK], _part(b, s, s + _CHUNK, a.device))
            blob[s // 8 : (s + m.numel() + 7) // 8].copy_(pack_mask(m))
            got = torch.masked_select(a[s : s + _CHUNK], m)
            values[at : at + got.numel()].copy_(got)
            at += got.numel()
    return Delta(index=index, changed=k, blob=blob, shape=shape, dtype=dtype)


def encode(new: torch.Tensor, base: torch.Tensor) -> Delta | None:
    """The delta from ``base`` to ``new`` (see :func:`diff`); None when dense is no bigger.
    A tensor with nothing changed gives a Delta with ``changed == 0`` (send nothing)."""
    return diff(new, base)[1]


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as a bitmap: ceil(n / 8) bytes, bit j of byte i for element 8i + j."""
    return torch.from_numpy(np.packbits(mask.cpu().numpy(), bitorder="little"))


def pack_bits(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """The bitmap of ascending ``positions``: ceil(numel / 8) bytes, a chunk at a time."""
    positions = positions.cpu()
    out = torch.empty((numel + 7) // 8, dtype=torch.uint8)
    bounds = torch.searchsorted(positions, torch.arange(0, numel + _CHUNK, _CHUNK)).tolist()
    for c, s in enumerate(range(0, numel, _CHUNK)):
        mask = _scratch.bools(min(_CHUNK, numel - s)).fill_(False)
        mask[positions[bounds[c] : bounds[c + 1]] - s] = True
        out[s // 8 : s // 8 + (mask.numel() + 7) // 8].copy_(pack_mask(mask))
    return out


def unpack_bits(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """A bool per element of a bitmap (bits past numel included, up to a multiple of 8)."""
    return torch.from_numpy(np.unpackbits(bitmap.cpu().numpy(), bitorder="little")).view(torch.bool)


def decode(blob: torch.Tensor, m: ParamMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values) of a received delta, for :func:`apply`; DeltaError if its bytes are
    inconsistent. ``values`` views ``blob`` (copy before it is reused)."""
    if problem := delta_layout_problem(m):
        raise DeltaError(f"delta of {m.name!r}: {problem}")
    if blob.dtype != torch.uint8 or blob.numel() != m.nbytes:
        raise DeltaError(f"delta of {m.name!r}: {blob.numel()} bytes, metadata says {m.nbytes}")
    numel = math.prod(m.shape)
    block = blob[: m.index_nbytes]
    if m.index == "int32":
        where = block.view(torch.int32).to(torch.int64)
        if where.numel() and (
            int(where[0]) < 0
            or int(where[-1]) >= numel
            or (where.numel() > 1 and not bool((where[1:] > where[:-1]).all()))
        ):
            raise DeltaError(f"delta of {m.name!r}: indices are not ascending within 0..{numel - 1}")
    else:
        mask = unpack_bits(block, numel)
        if bool(mask[numel:].any()):
            raise DeltaError(f"delta of {m.name!r}: bitmap bits set past element {numel - 1}")
        where = torch.from_numpy(np.flatnonzero(mask[:numel].numpy()))
        marked = where.numel()
        if marked != m.changed:
            raise DeltaError(f"delta of {m.name!r}: bitmap marks {marked} elements, metadata says {m.changed}")
    values = blob[m.values_offset :].view(torch_dtype(m.dtype))
    return where, values


_POPCOUNT = None


def _ascending(where: np.ndarray) -> bool:
    """Whether int32 indices strictly ascend, checked a cache-sized run at a time."""
    step, last = 1 << 20, where.size - 1
    return all(
        bool(np.all(where[s + 1 : min(s + step, last) + 1] > where[s : min(s + step, last)]))
        for s in range(0, last, step)
    )


def write(out: torch.Tensor, blob: torch.Tensor, m: ParamMeta) -> None:
    """Decode a received delta and write it onto ``out`` (its base, contiguous); DeltaError,
    before anything is written, if its bytes are inconsistent. A bitmap on the host is applied
    a chunk at a time, never expanded to a position list or a full-size mask. On a device (or
    forced there, see :func:`on_device`) it is decoded and scattered with torch ops there."""
    global _POPCOUNT
    if problem := delta_layout_problem(m):
        raise DeltaError(f"delta of {m.name!r}: {problem}")
    if blob.dtype != torch.uint8 or blob.numel() != m.nbytes:
        raise DeltaError(f"delta of {m.name!r}: {blob.numel()} bytes, metadata says {m.nbytes}")
    if (
        not out.is_contiguous()
        or out.numel() != math.prod(m.shape)
        or out.element_size() != torch_dtype(m.dtype).itemsize
    ):
        raise DeltaError(f"delta of {m.name!r} is applied onto a contiguous tensor of its shape")
    if on_device(out) or blob.device.type != "cpu":
        where, values = decode(blob, m)
        apply(out, where, values)
        return
    numel = out.numel()
    if m.index == "int32":  # numpy, on the int32 indices as they came: no int64 copy of them
        where = blob[: m.index_nbytes].numpy().view(np.int32)  # type: ignore[assignment]
        if int(where[0]) < 0 or int(where[-1]) >= numel or not _ascending(where):  # type: ignore[arg-type]
            raise DeltaError(f"delta of {m.name!r}: indices are not ascending within 0..{numel - 1}")
        from rlbus.transfer.delta_kernel import scatter  # numba's import: on the first delta only

        lane_t = _UINT[out.element_size()]
        new_bits = blob[m.values_offset :].numpy().view(lane_t)
        if new_bits.size != where.size:  # the compiled scatter reads both unchecked
            raise DeltaError(f"delta of {m.name!r}: {where.size} positions, {new_bits.size} values")
        scatter(bits(out).numpy().view(lane_t), where, new_bits)
        return
    block = blob[: m.index_nbytes].numpy()
    if _POPCOUNT is None:
        _POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
    if numel % 8 and int(block[-1]) >> (numel % 8):
        raise DeltaError(f"delta of {m.name!r}: bitmap bits set past element {numel - 1}")
    marked = int(_POPCOUNT[block].sum())
    if marked != m.changed:
        raise DeltaError(f"delta of {m.name!r}: bitmap marks {marked} elements, metadata says {m.changed}")
    o = bits(out).numpy()
    v = blob[m.values_offset :].view(_BITS[torch_dtype(m.dtype).itemsize]).numpy()
    at = 0
    for s in range(0, numel, _CHUNK):  # _CHUNK is a multiple of 8
        e = min(s + _CHUNK, numel)
        mask = np.unpackbits(block[s // 8 : (e + 7) // 8], bitorder="little")[: e - s].view(np.bool_)
        k = int(np.count_nonzero(mask))
        o[s:e][mask] = v[at : at + k]
        at += k


def apply(out: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` where ``where`` says (int64 flat positions, or a bool mask of every
    element) into ``out`` (contiguous), bit for bit."""
    if not out.is_contiguous():
        raise DeltaError("a delta is applied onto a contiguous tensor")
    v = values.reshape(-1).view(_BITS[values.element_size()]).to(out.device)
    where = where.to(out.device)
    if where.dtype == torch.bool:
        bits(out).masked_scatter_(where, v)
    else:
        bits(out).index_copy_(0, where, v)
