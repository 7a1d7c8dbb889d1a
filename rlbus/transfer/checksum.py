"""Checksums of buckets and tensors: xxh3-128 on the host, or rlbus's device checksum.

Two algorithms, both 128 bits (32 lowercase hex digits on the wire):

* ``xxh3`` — xxh3-128 over a CPU byte buffer, read in place (no copy): ~10 GB/s a core. The
  default of the host backends (gloo, shm); a buffer on another device is copied to the host.
* ``device`` — computed with torch integer ops on the device the bytes live on (CUDA for NCCL),
  so nothing crosses PCIe to be hashed; the same ops on CPU give the same digest, which is how
  CI exercises it (``RLBUS_CHECKSUM=device``). Defined below (:func:`device_checksum`). On one
  CPU thread it runs at 0.4-0.7 GB/s (bench/transfer.py: 0.09-0.15x a memcpy): a CPU path
  for tests, not for speed; on a GPU it is ~14 element-wise kernels over L2-sized blocks.

Which one a group uses: :func:`checksum_kind` (``RLBUS_CHECKSUM`` wins; else ``device`` for
nccl, ``xxh3`` otherwise). Both ends of a group must agree, so the trainer and every worker
decide it the same way, from the backend and the environment.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Literal

import torch
import xxhash

ChecksumKind = Literal["xxh3", "device"]
KINDS: tuple[ChecksumKind, ...] = ("xxh3", "device")
ENV = "RLBUS_CHECKSUM"
"""``xxh3`` or ``device``: forces the algorithm on every backend (``device`` on CPU runs the
device checksum over gloo/shm, so CI covers the NCCL path's checks; ``xxh3`` on nccl stages
each bucket on the host to hash it there)."""


def checksum_kind(backend: str | None = None) -> ChecksumKind:
    """The algorithm a group of ``backend`` uses (None: the fleet's default for whole-tensor
    checks that belong to no group, e.g. ``hash_weights``): ``RLBUS_CHECKSUM`` when set, else
    ``device`` for nccl and ``xxh3`` for the host backends."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced:
        if forced not in KINDS:
            raise ValueError(f"{ENV}={forced!r}: expected one of {KINDS}")
        return forced  # type: ignore[return-value]
    return "device" if backend == "nccl" else "xxh3"


def checksum(buf: torch.Tensor, kind: ChecksumKind | None = None, *, seed: int = 0) -> str:
    """Hex digest (32 digits) of a contiguous uint8 tensor's bytes.

    ``kind`` None: the device checksum for a tensor off the host, else :func:`checksum_kind`'s
    default. ``seed`` (the device checksum only): a bucket's index in its update, so a bucket
    received in another's place never matches; xxh3 digests stay unseeded (the bucket's place
    is checked by the order of the list)."""
    if buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("checksum needs a contiguous uint8 tensor")
    if kind is None:
        kind = "device" if buf.device.type != "cpu" else checksum_kind()
    if kind == "device":
        return device_checksum(buf, seed)
    if buf.device.type != "cpu":
        buf = buf.cpu()
    n = buf.numel()
    if n == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    view = (ctypes.c_char * n).from_address(buf.data_ptr())
    return xxhash.xxh3_128_hexdigest(memoryview(view))


# ---- xxh3 fed from compiled code -------------------------------------------------------------
#
# The delta compare (delta_kernel.scan) hashes each slice of the new bytes while the slice is in
# cache, inside its one compiled call a tensor: fed from Python a slice at a time, every slice
# would take the GIL back twice, and two compare threads (beside the trainer's event loop and
# sender) wait for it hundreds of times a push. The xxhash wheel's extension module exports
# xxHash's C API; numba calls its update through ctypes (a ctypes function passed as an
# argument, so the compiled code is still cached on disk). Where the symbols are missing,
# :func:`native_stream` is None and callers hash in a second pass (:func:`checksum`).


class _Xxh3Lib:
    """xxHash's streaming XXH3-128 API, from the xxhash wheel's extension module."""

    class Hash128(ctypes.Structure):
        _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]

    def __init__(self) -> None:
        from xxhash import _xxhash  # type: ignore[attr-defined]  # the wheel's C extension (xxHash itself)

        lib = ctypes.CDLL(_xxhash.__file__)
        self.create = lib.XXH3_createState
        self.create.restype, self.create.argtypes = ctypes.c_void_p, []
        self.free = lib.XXH3_freeState
        self.free.restype, self.free.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self.reset = lib.XXH3_128bits_reset
        self.reset.restype, self.reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self.update = lib.XXH3_128bits_update
        self.update.restype = ctypes.c_int
        self.update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.digest = lib.XXH3_128bits_digest
        self.digest.restype, self.digest.argtypes = self.Hash128, [ctypes.c_void_p]


class NativeXxh3:
    """One XXH3-128 state (this thread's: see :func:`native_stream`), fed by compiled code
    through ``update(state, address, nbytes)``; :meth:`hexdigest` equals
    ``xxhash.xxh3_128_hexdigest`` of the bytes fed since :meth:`reset`."""

    def __init__(self, lib: _Xxh3Lib) -> None:
        self._lib = lib
        self.update = lib.update
        self.reset_fn = lib.reset
        self.state = lib.create()
        if not self.state:
            raise MemoryError("XXH3_createState failed")

    def reset(self) -> int:
        """Start a new digest; returns the state's address for the compiled code."""
        self._lib.reset(self.state)
        return self.state

    def fresh(self) -> NativeXxh3:
        """Another state of the same library (a compiled call feeding many digests at once)."""
        return NativeXxh3(self._lib)

    def hexdigest(self) -> str:
        h = self._lib.digest(self.state)
        return f"{h.high64:016x}{h.low64:016x}"

    def __del__(self) -> None:
        if getattr(self, "state", None):
            self._lib.free(self.state)
            self.state = None


class _Streams(threading.local):
    stream: NativeXxh3 | None = None


_streams = _Streams()
_lib: _Xxh3Lib | None = None
_lib_missing = False
_lib_lock = threading.Lock()


_UPDATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_no_update = _UPDATE(lambda state, address, nbytes: 0)


def native_update():
    """The update function compiled code is handed with no stream (state 0: never called)."""
    native_stream()
    return _lib.update if _lib is not None else _no_update


def native_stream() -> NativeXxh3 | None:
    """This thread's XXH3-128 state for compiled code (kept for the thread's life), or None
    when the xxhash wheel does not export xxHash's C API."""
    global _lib, _lib_missing
    if _streams.stream is not None:
        return _streams.stream
    with _lib_lock:
        if _lib is None and not _lib_missing:
            try:
                _lib = _Xxh3Lib()
            except (OSError, AttributeError):
                _lib_missing = True
        lib = _lib
    if lib is None:
        return None
    _streams.stream = NativeXxh3(lib)
    return _streams.stream


# ---- the device checksum ---------------------------------------------------------------------
#
# The bytes are read as little-endian 64-bit words w[i] (a last partial word zero-padded; the
# length enters the digest). Words are grouped in chunks of CHUNK_WORDS; j = i mod CHUNK_WORDS
# is a word's place in its chunk, c = i // CHUNK_WORDS its chunk. Arithmetic is mod 2^64
# (torch int64 with wrap-around: exact, so the order of a reduction cannot change it):
#
#     key[j] = j * G
#     x      = splitmix64 finalizer of (w[i] xor key[j])      (a bijection of 64-bit words)
#     A[c]   = sum of x over the chunk,   B[c] = sum of x * (key[j] | 1) over the chunk
#     A = sum_c fmix(A[c] + c * G),       B = sum_c fmix(B[c] xor c * G)
#     L = fmix(nbytes xor fmix(seed + G))
#     digest = fmix(A + L) . fmix(B xor L)        (two 64-bit halves, hex)
#
# The chunk is part of the definition (not of the device), so a device may reduce many chunks
# in one kernel (rows of a [rows, CHUNK_WORDS] view) and get the same sums as the host does one
# chunk at a time in cache.

CHUNK_WORDS = 1 << 17
"""64-bit words a chunk (1 MiB): on the host both scratch chunks stay in the core's cache."""

_M64 = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def _signed(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


def _fmix(z: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2^64)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


_C1S, _C2S = _signed(_C1), _signed(_C2)
_LOW34, _LOW37, _LOW33 = (1 << 34) - 1, (1 << 37) - 1, (1 << 33) - 1


class _Tables(threading.local):
    """Per thread and device: the key table and two scratch blocks of ``rows`` chunks."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        got = self.by_device.get(device)
        if got is None or got[2].shape[0] < rows:
            key = torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device).mul_(_signed(_G))
            odd = key | 1
            got = (
                key,
                odd,
                torch.empty(rows, CHUNK_WORDS, dtype=torch.int64, device=device),
                torch.empty(rows, CHUNK_WORDS, dtype=torch.int64, device=device),
            )
            self.by_device[device] = got
        return got


_tables = _Tables()

DEVICE_ROWS = 16
"""Chunks reduced in one kernel off the host: 16 MiB a scratch block, so the two blocks the ~14
passes read and write stay in a GPU's L2 (50 MB on an H100) and only the bucket itself is read
from HBM, while each launch (~5 us) still has 2M words to work on."""


def _mix_rows(w: torch.Tensor, key: torch.Tensor, odd: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """Per row of ``w`` ([rows, n] int64 words), the sums (A, B) of its mixed words."""
    torch.bitwise_xor(w, key, out=x)
    # splitmix64's finalizer; ">>" on int64 is arithmetic, so mask the sign bits back out
    torch.bitwise_right_shift(x, 30, out=y)
    y.bitwise_and_(_LOW34)
    x.bitwise_xor_(y)
    x.mul_(_C1S)
    torch.bitwise_right_shift(x, 27, out=y)
    y.bitwise_and_(_LOW37)
    x.bitwise_xor_(y)
    x.mul_(_C2S)
    torch.bitwise_right_shift(x, 31, out=y)
    y.bitwise_and_(_LOW33)
    x.bitwise_xor_(y)
    a = x.sum(dim=1)
    x.mul_(odd)
    return a, x.sum(dim=1)


def _words(flat: torch.Tensor) -> torch.Tensor:
    """The whole 64-bit words of a flat uint8 tensor, as int64 (a copy only if misaligned)."""
    whole = flat.numel() // 8 * 8
    part = flat[:whole]
    if part.data_ptr() % 8:
        part = part.clone()
    return part.view(torch.int64)


def device_checksum(buf: torch.Tensor, seed: int = 0) -> str:
    """rlbus's device checksum (see above) of a contiguous uint8 tensor on any device.

    What it catches: any change confined to one 8-byte word (every flipped bit of it) always
    changes both halves (the mix is a bijection and each sum moves by a nonzero amount); a
    change of length always changes L; a word moved elsewhere in its chunk meets another key,
    a chunk moved meets another chunk weight, a bucket in another's place another seed. Beyond
    that (several words changed at once) a corruption escapes only if the mixed differences
    cancel in both sums: for bytes that are not built to collide, about 2^-64 per comparison
    (taking the two 64-bit sums as one; they are not independent). It is not cryptographic:
    the checksums guard against corruption, the control plane's authentication against forgery.
    """
    flat = buf.reshape(-1)
    n = flat.numel()
    words = _words(flat)
    nw = words.numel()
    device = flat.device
    rows = 1 if device.type == "cpu" else DEVICE_ROWS
    key, odd, xs, ys = _tables.get(device, rows)
    parts_a: list[torch.Tensor] = []
    parts_b: list[torch.Tensor] = []
    full = nw // CHUNK_WORDS
    grid = words[: full * CHUNK_WORDS].view(full, CHUNK_WORDS)
    for r in range(0, full, rows):
        block = grid[r : r + rows]
        a, b = _mix_rows(block, key, odd, xs[: block.shape[0]], ys[: block.shape[0]])
        parts_a.append(a)
        parts_b.append(b)
    rest = nw - full * CHUNK_WORDS
    tail = n - nw * 8
    if rest or tail:
        last = words[full * CHUNK_WORDS :]
        if tail:  # the partial word, zero-padded, is the chunk's next word
            pad = torch.zeros(8, dtype=torch.uint8, device=device)
            pad[:tail] = flat[nw * 8 :]
            last = torch.cat([last, pad.view(torch.int64)])
        m = last.numel()
        a, b = _mix_rows(last.view(1, m), key[:m], odd[:m], xs[0, :m].view(1, m), ys[0, :m].view(1, m))
        parts_a.append(a)
        parts_b.append(b)
    sa = torch.cat(parts_a).tolist() if parts_a else []
    sb = torch.cat(parts_b).tolist() if parts_b else []
    big_a = big_b = 0
    for c, (ca, cb) in enumerate(zip(sa, sb)):
        big_a += _fmix(ca + c * _G)
        big_b += _fmix((cb & _M64) ^ ((c * _G) & _M64))
    length = _fmix(n ^ _fmix(seed + _G))
    return f"{_fmix(big_a + length):016x}{_fmix((big_b & _M64) ^ length):016x}"
