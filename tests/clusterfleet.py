"""Helpers of the cluster tests (a real 3-node NATS cluster on loopback): an in-process fleet
on the cluster, a subscriber on one node that records what it receives, a probe that a KV
bucket takes writes again after its nodes came back, and a wait for every replica to be current."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import msgspec
import nats
from nats.js.api import KeyValueConfig, StorageType
from rlbus.schemas import Subjects, VersionInfo
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.runners.local import LocalFleet
from rlbus.runners.natsserver import NatsCluster
from rlbus.sdk.client import RLClient
from tests.waiting import eventually
from tests.weights_helpers import MODEL


@asynccontextmanager
async def cluster_fleet(
    cluster: NatsCluster,
    prefix: str,
    workers: Sequence[str],
    backend: str,
    *,
    trainer_timeout: float,
    trainer_on_controllers_node: bool = False,
    **controller_kw: float,
) -> AsyncIterator[tuple[LocalFleet, RLClient]]:
    """A controller (ControllerOptions(**controller_kw)) and `workers` serving MODEL over
    `backend`, all given every node's URL, and a trainer's client: given every node too, or
    only the controller's node (`trainer_on_controllers_node`). Everything is closed after."""
    subjects = Subjects(prefix=prefix)
    f = LocalFleet(cluster.url)
    rl = None
    try:
        await f.start_controller(ControllerOptions(subjects=subjects, **controller_kw))  # type: ignore[arg-type]
        for wid in workers:
            await f.start_worker(
                ReferenceEngine(MODEL),
                WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.25, weight_transfer_backend=backend),
            )
        await f.wait_for_workers(workers)
        assert f.controller is not None
        url = f"nats://127.0.0.1:{f.controller.nc.connected_url.port}" if trainer_on_controllers_node else cluster.url
        rl = await RLClient.connect(url, prefix=prefix, timeout=trainer_timeout)
        yield f, rl
    finally:
        if rl is not None:
            await rl.close()
        await f.close()


class Published:
    """Every event on `subject` (a VersionInfo, or `kind`), decoded, as a subscriber connected
    to `url` receives it (nats.connect(**connect_kw): by default core NATS gives up on a node
    that stays away)."""

    def __init__(self, url: str, subject: str, kind: type = VersionInfo, **connect_kw: object) -> None:
        self.url, self.subject, self.kind, self.connect_kw = url, subject, kind, connect_kw
        self.seen: list = []

    async def __aenter__(self) -> Published:
        decoder = msgspec.json.Decoder(self.kind)
        self.nc = await nats.connect(self.url, **self.connect_kw)  # type: ignore[arg-type]

        async def on(msg) -> None:
            self.seen.append(decoder.decode(msg.data))

        await self.nc.subscribe(self.subject, cb=on)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    def versions(self) -> list[str]:
        return [v.version for v in self.seen]


async def takes_writes(nc, bucket: str) -> bool:
    """The KV bucket's stream acknowledges a write: after its nodes come back (or a partition
    heals) an elected leader may still answer 503 ("JetStream system temporarily unavailable")
    while its replicas catch up, and the controller's writes then fail as UNAVAILABLE."""
    try:
        kv = await nc.jetstream(timeout=1.0).key_value(bucket)
        await kv.put("probe-quorum", b"1")
    except Exception:
        return False
    return True


async def jetstream_formed(url: str, timeout: float = 60.0) -> None:
    """Wait until a 3-replica bucket can be created through the node at `url`. A fresh cluster
    elects its JetStream meta leader seconds after start, and then may refuse to place replicas
    ("no suitable peers for placement") while the routes settle; behind proxies and on a loaded
    machine that once outlasted a controller's 30 s start. Tests about faults wait for it first."""
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=2.0)

    async def placed() -> bool:
        try:
            await js.create_key_value(KeyValueConfig(bucket="formed", replicas=3, storage=StorageType.FILE))
        except Exception:
            return False
        return True

    try:
        await eventually(placed, timeout=timeout, interval=0.25, what=f"a 3-replica bucket created through {url}")
    finally:
        await nc.close()


async def streams_current(nc, subjects: Subjects) -> None:
    """Wait until the state and answer buckets' streams each have a leader and every replica is
    current. A node started again (same store) is running long before its replicas have caught
    up: until then, losing another node leaves a stream without quorum (a fresh-clone run saw the
    state stream leaderless for over 30 s so). Wait on this before killing the next node."""
    js = nc.jetstream(timeout=1.0)

    async def current() -> bool:
        for stream in (subjects.kv_stream, f"KV_{subjects.replies_bucket}"):
            try:
                info = await js.stream_info(stream)
            except Exception:
                return False
            c = info.cluster
            if c is None or c.leader is None or not all(r.current for r in c.replicas or []):
                return False
        return True

    await eventually(current, timeout=30, interval=0.1, what="the state and answer streams' replicas all current")
