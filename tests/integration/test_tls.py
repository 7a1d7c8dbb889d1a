"""The generated config with TLS: the server presents a certificate, clients verify it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import rlbus
from rlbus.bus.connection import NatsAuth
from rlbus.runners.natsconfig import Tls, read_env_file, write_config
from rlbus.runners.natsserver import NatsServer
from rlbus.sdk.client import RLClient

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "server.pem", folder / "server-key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(folder)
    paths = write_config(folder / "conf", tls=Tls(cert=str(cert), key=str(key)))
    with NatsServer(config_file=paths["config"]) as server:
        yield server, paths, cert


def _trainer(paths, **tls) -> NatsAuth:
    env = read_env_file(paths["trainer"])
    return NatsAuth(
        user=env["RLBUS_NATS_USER"], password=env["RLBUS_NATS_PASSWORD"], inbox=env["RLBUS_NATS_INBOX"], **tls
    )


async def test_a_client_that_trusts_the_servers_ca_connects_over_tls(tls_server):
    server, paths, cert = tls_server
    rl = await RLClient.connect(server.url, auth=_trainer(paths, tls_ca=str(cert)), timeout=5)
    try:
        assert rl.nc.is_connected
        with pytest.raises(rlbus.Unavailable):  # no controller here: the request itself went through TLS
            await rl.server_info()
    finally:
        await rl.close()


async def test_a_client_that_does_not_trust_the_certificate_is_refused(tls_server):
    server, paths, _ = tls_server
    with pytest.raises(rlbus.RLBusError):
        await RLClient.connect(server.url, auth=_trainer(paths, tls_ca=None), timeout=5)
