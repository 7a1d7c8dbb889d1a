"""Every benchmark script runs end to end at a toy size and prints its ratios.

No timing is asserted (speed targets live in the scripts' output, not in tests, which would
flake on a shared machine); this only keeps the scripts from rotting.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RATIO = r"\d+\.\d\d"


def _run(script: str, *args: str, timeout: float = 180) -> str:
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, f"{script} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.parametrize(
    ("script", "args", "expect"),
    [
        (
            "transfer.py",
            ["--size-mb", "4", "--receivers", "1", "--reps", "1", "--bucket-mb", "1", "--shm-bucket-mb", "1"]
            + ["--ops-mb", "2"],
            [
                rf"rlbus/raw\s+=\s+{RATIO}",
                rf"rlbus/naive\s+=\s+{RATIO}",
                rf"shm/memcpy\s+=\s+{RATIO}",
                rf"device checksum .* /memcpy = {RATIO}",
                rf"device compare .* /memcpy = {RATIO}",
            ],
        ),
        (
            "push.py",
            ["--size-mb", "8", "--receivers", "1", "--reps", "1", "--bucket-mb", "1"],
            [rf"^\s+1(\s+{RATIO}){{7}}$"],  # raw, rlbus, rlbus/raw, bare, rlbus/bare, landed, rlbus/landed
        ),
        (
            "push.py",
            ["--model", "small", "--size-mb", "8", "--receivers", "1", "--reps", "1", "--bucket-mb", "1"],
            [rf"^\s+1(\s+{RATIO}){{9}}$"],  # and naive, rlbus/naive
        ),
        (
            "delta.py",
            ["--size-mb", "4", "--receivers", "1", "--reps", "1", "--warmup", "1", "--bucket-mb", "1"],
            [rf"^\s+1\s+1e-06\s+{RATIO}%", rf"^\s+1\s+1e-05\s+{RATIO}%"],
        ),
        ("control.py", ["--workers", "2", "--rounds", "2"], [rf"^\s+2\s+{RATIO}\s+{RATIO}\s+{RATIO}"]),
        (
            "device_paths.py",
            ["--device", "cpu", "--size-mb", "8", "--reps", "1"],
            [
                r"^PASS device checksum equals the host's",
                r"^PASS device delta round trip bit-identical",
                r"^INFO device checksum throughput: \d+\.\d\d GB/s",
                r"^PASS bytes stay on the device",
                r"^PASS bucket checksums agree",
                r"^PASS delta results bit-identical",
                rf"^(PASS|INFO) dense push vs raw broadcast: {RATIO}x",
                rf"^(PASS|INFO) delta push vs dense push: {RATIO}x",
            ],
        ),
        (
            "repair.py",
            ["--size-mb", "8", "--reps", "1", "--bucket-mb", "1"],
            [rf"^\s+{RATIO}\s+{RATIO}\s+{RATIO}\s+{RATIO}$"],
        ),
        # at a toy size a worker's fixed allocations dwarf the model: only the table is checked
        (
            "memory.py",
            ["--size-mb", "8", "--bucket-mb", "1", "--pushes", "1"],
            [rf"^staged\s+\d+Mi.*{RATIO}x", rf"^in_place\s+\d+Mi.*{RATIO}x"],
        ),
    ],
    ids=["transfer", "push", "push-small", "delta", "control", "device-paths", "repair", "memory"],
)
def test_benchmark_script_runs_and_prints_its_ratios(script, args, expect):
    out = _run(script, *args)
    for pattern in expect:
        assert re.search(pattern, out, re.MULTILINE), f"{script}: no line matching {pattern!r} in:\n{out}"
