"""Fixtures of the integration tests: the loop-lag guard around every fault test."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator

import nats
import nats.aio.client
import pytest

from tests.looplag import LoopLag

FAULT_MODULES = (
    "test_faults_",
    "test_abort_never_blocks",
    "test_deadlines",
    "test_reconciliation",
    "test_failover",
    "test_soak",
    "test_state_loss",
    "test_idempotency",
)
LAG_BOUND_S = 1.0
"""Generous on a loaded 2-core box; a blocked loop (a join, a teardown) stalls for the whole
collective timeout (20-60 s), which this still catches. Tests about blocking set tighter bounds."""


@pytest.fixture
async def raw(nats_server) -> AsyncIterator[nats.aio.client.Client]:
    """A bare NATS connection, as `nats req` or a foreign client would use."""
    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()


@pytest.fixture(autouse=True)
async def loop_lag_guard(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Fail a fault test whose services stalled the event loop (they share the test's loop)."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    if not module.startswith(FAULT_MODULES) or not inspect.iscoroutinefunction(request.function):
        yield
        return
    async with LoopLag(bound=LAG_BOUND_S):
        yield
