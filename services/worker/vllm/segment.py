"""The committed weights of a vLLM worker, in one shared-memory segment both processes map.

A model folder in /dev/shm whose `model.safetensors` holds exactly the last committed bits, in
checkpoint names. It is the only copy besides vLLM's live (renamed, fused, repacked) parameters:

- vLLM starts from this folder, and restarts from it after a failed load;
- vLLM's worker process maps it writable: a delta's base is read there, and a commit writes the
  tensors it changed in place (a safetensors file has a fixed layout: every tensor keeps its
  bytes' offset), after vLLM's own load succeeded;
- the rlbus worker process maps it too, for what reads the committed bits (a repair source,
  hash_weights), and never writes it.

Needs neither vllm nor safetensors (the header is JSON after an 8-byte length).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from . import checkpoint


def create(source: str | Path, dest: str | Path) -> Path:
    """A copy of the model folder `source` (config and all) with its checkpoint as one
    `model.safetensors` (what a segment maps): the folder vLLM starts from."""
    dst = Path(dest)
    checkpoint.write_model_folder(source, dst, checkpoint.read_tensors(source))
    return dst


def remove(folder: str | Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


PREFIX = "rlbus-vllm-"
"""Segment roots are named PREFIX + the owning process's pid + "-" + a random suffix."""


def sweep(root: str | Path) -> list[Path]:
    """Remove the segment roots under `root` whose owning process is gone (a worker killed
    before it could remove its own); returns them."""
    gone = []
    for d in Path(root).glob(f"{PREFIX}*-*"):
        pid = d.name.removeprefix(PREFIX).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            remove(d)
            gone.append(d)
        except PermissionError:  # alive, someone else's
            pass
    return gone


class Segment:
    """The tensors of a segment folder's `model.safetensors`, as views of a shared mapping
    (writes reach the file, and every process that maps it)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        path = self.folder / checkpoint.WEIGHTS_FILE
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        (n,) = struct.unpack("<Q", self._map[:8])
        header = json.loads(self._map[8 : 8 + n])
        start = 8 + n
        self.tensors: dict[str, torch.Tensor] = {}
        """Name -> a view of its committed bytes (CPU)."""
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = checkpoint._DTYPES[info["dtype"]]
            b, e = info["data_offsets"]
            flat = torch.frombuffer(self._map, dtype=torch.uint8, count=e - b, offset=start + b)
            self.tensors[name] = flat.view(dtype).reshape(info["shape"])
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        """The committed tensors' bytes, counted once: a worker reports them in every command's ack."""

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make `tensors` the committed bits of their names (each already checked against the
        checkpoint's dtype and shape)."""
        for name, t in tensors.items():
            dst = self.tensors[name]
            if t.data_ptr() != dst.data_ptr():
                dst.copy_(t)

    def close(self) -> None:
        self.tensors, self.nbytes = {}, 0
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
