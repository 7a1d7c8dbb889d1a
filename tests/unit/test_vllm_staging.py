"""Where a staged update waits for its commit inside vLLM's worker process (VllmOptions.staging):
host memory unless device staging was asked and the update fits in the GPU's free memory."""

from __future__ import annotations

import logging

import pytest
import torch
from rlbus.services.worker.vllm.extension import STAGING_HEADROOM, staging_device

MiB = 1 << 20


def test_host_staging_never_asks_the_device():
    assert staging_device("host", 10 * MiB, free=None) is None
    assert staging_device("host", 10 * MiB, free=1 << 40) is None


def test_device_staging_without_a_gpu_or_room_falls_back_to_the_host_and_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="rlbus.worker.vllm"):
        assert staging_device("device", 10 * MiB, free=None) is None
        assert staging_device("device", 10 * MiB, free=10 * MiB + STAGING_HEADROOM - 1) is None
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "no GPU",
        f"10 MiB + headroom > {(10 * MiB + STAGING_HEADROOM - 1) >> 20} MiB free",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_staging_that_fits_lands_on_the_current_gpu():
    free = torch.cuda.mem_get_info()[0]
    assert staging_device("device", MiB, free) == torch.device("cuda", torch.cuda.current_device())
