"""The documented payload limit holds whatever the NATS server allows: on a server whose
max_payload is 16 MiB, a command over 8 MiB (MAX_COMMAND_BYTES) is a 400 (rlbus.BadRequest from
the SDK) and changes nothing; one just under it still runs."""

from __future__ import annotations

import msgspec
import nats
import pytest
from rlbus.schemas import MAX_COMMAND_BYTES, FleetAck, Pause, Subjects, encode, reply_decoder

import rlbus
from rlbus.runners.natsserver import NatsServer
from tests.fleet import fleet_running


@pytest.fixture(scope="module")
def roomy_server(tmp_path_factory):
    conf = tmp_path_factory.mktemp("conf") / "payload.conf"
    conf.write_text("max_payload: 16777216\n")
    with NatsServer(config_file=conf) as server:
        yield server


@pytest.fixture(scope="module")
async def fleet(roomy_server, prefix):
    async with fleet_running(roomy_server.url, prefix, ["p0", "p1"]) as running:
        yield running


def padded_pause(size: int) -> bytes:
    """A pause command of `size` bytes (an unknown field pads it: it decodes as a plain pause)."""
    base = len(encode(Pause(mode="abort"))) + len(b',"pad":""')
    return encode(Pause(mode="abort"))[:-1] + b',"pad":"' + b"x" * (size - base) + b'"}'


async def test_a_command_over_8_mib_is_a_400_and_pauses_nothing(fleet, roomy_server, prefix):
    f, rl = fleet
    nc = await nats.connect(roomy_server.url)
    try:
        assert nc.max_payload >= 16 << 20
        msg = await nc.request(Subjects(prefix).control("pause"), padded_pause(9 << 20), timeout=10)
        assert msg.headers is not None and msg.headers.get("Nats-Service-Error-Code") == "400", msg.headers
        assert "over the limit" in msg.headers.get("Nats-Service-Error", "")
        assert not await rl.is_paused()
        assert not any(w.state().paused for w in f.workers.values())
        # the limit itself is fine
        reply = reply_decoder.decode(
            (await nc.request(Subjects(prefix).control("pause"), padded_pause(MAX_COMMAND_BYTES), timeout=10)).data
        )
        assert isinstance(reply, FleetAck) and all(w.paused for w in reply.workers)
        await rl.resume()
    finally:
        await nc.close()


async def test_the_sdk_raises_bad_request_for_a_command_over_8_mib(fleet):
    f, rl = fleet
    huge = msgspec.structs.replace(Pause(mode="abort"), command_id="c" * (9 << 20))
    with pytest.raises(rlbus.BadRequest, match="over the limit"):
        await rl.call(huge, FleetAck)
    assert not any(w.state().paused for w in f.workers.values())
