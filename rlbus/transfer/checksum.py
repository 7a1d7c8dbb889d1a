"""Bucket checksums: xxh3-128 over a CPU byte buffer, read in place (no copy)."""

from __future__ import annotations

import ctypes

import torch
import xxhash


def checksum(buf: torch.Tensor) -> str:
    """Hex xxh3-128 digest of a contiguous CPU uint8 tensor's bytes.

    The bytes are hashed where they lie (a ctypes view of ``buf.data_ptr()``), so
    hashing runs at memory speed and allocates nothing. A zero-length buffer has
    the digest of the empty string.
    """
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("checksum needs a contiguous CPU uint8 tensor")
    n = buf.numel()
    if n == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    view = (ctypes.c_char * n).from_address(buf.data_ptr())
    return xxhash.xxh3_128_hexdigest(memoryview(view))
