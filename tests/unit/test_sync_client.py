"""SyncRLClient with nowhere to connect, no NATS: the refusal, and no thread left behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

import rlbus
from rlbus.sdk.client import SyncRLClient
from tests.waiting import eventually


async def test_sync_client_without_a_url_raises_unavailable_and_leaves_no_thread(monkeypatch):
    monkeypatch.delenv("RLBUS_NATS_URL", raising=False)

    def foreign_threads() -> set[threading.Thread]:
        # asyncio.to_thread's own pool may grow by a thread; any other new thread is the portal's
        return {t for t in threading.enumerate() if not t.name.startswith("asyncio_")}

    before = foreign_threads()

    with pytest.raises(rlbus.Unavailable):
        await asyncio.to_thread(SyncRLClient, None)

    await eventually(lambda: foreign_threads() <= before, timeout=5, what="portal thread gone")
