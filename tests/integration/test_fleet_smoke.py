from __future__ import annotations

import pytest

from tests.fleet import fleet_running


@pytest.fixture(scope="module")
async def fleet(nats_server, prefix):
    async with fleet_running(nats_server.url, prefix) as running:
        yield running


async def test_server_info_lists_every_registered_worker(fleet):
    _, rl = fleet
    info = await rl.server_info()
    assert [w.worker_id for w in info.workers] == ["w0", "w1"]
    assert info.capabilities.sleep_mode_enabled
    assert info.weight_version == "default"


async def test_generation_reply_names_worker_and_version(fleet):
    _, rl = fleet
    reply = await rl.generate([1, 2, 3], 8)
    assert len(reply.tokens) == 8 and reply.finish_reason == "length"
    assert reply.worker_id in ("w0", "w1") and reply.weight_version == "default"
