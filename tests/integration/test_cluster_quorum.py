"""Quorum loss on a real 3-node NATS cluster (loopback): with 2 of the 3 nodes killed (SIGKILL),
every state-changing call is UNAVAILABLE naming the state store's lost quorum (resent or not),
nothing is dispatched, committed or published; once the two nodes return (same ports, same
stores), the fleet recovers with its version intact, and the session left open finishes and
commits once."""

from __future__ import annotations

import anyio
import pytest
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError
from rlbus.schemas import FinishWeightUpdate, FleetAck, StartWeightUpdate, Subjects
from rlbus.services.controller.store import _open_bucket

import rlbus
from rlbus.runners.natsserver import NatsCluster
from tests.clusterfleet import cluster_fleet, takes_writes
from tests.waiting import eventually
from tests.weights_helpers import VersionEvents, assert_holds, new_version, trained

WORKERS = ("w0", "w1")
PATIENCE_S = 3.0
"""The controller's state store patience: a call without quorum is UNAVAILABLE after this."""


@pytest.fixture(scope="module")
def cluster():
    with NatsCluster(3) as c:
        yield c


@pytest.fixture(scope="module")
async def fleet(cluster, prefix):
    # the trainer sits on the controller's node: it survives the two kills with it
    async with cluster_fleet(
        cluster,
        prefix,
        WORKERS,
        "gloo",
        trainer_timeout=30.0,
        trainer_on_controllers_node=True,
        command_timeout_s=10,
        liveness_timeout_s=3.0,
        state_patience_s=PATIENCE_S,
    ) as running:
        yield running


async def _has_leader(nc, stream: str) -> bool:
    try:
        info = await nc.jetstream(timeout=1.0).stream_info(stream)
    except Exception:
        return False
    return info.cluster is not None and info.cluster.leader is not None


def _no_quorum(e: rlbus.RLBusError) -> bool:
    return e.code == "UNAVAILABLE" and "no quorum" in e.message and "state store" in e.message


async def test_without_quorum_nothing_changes_and_the_fleet_recovers_with_its_version(fleet, cluster, monkeypatch):
    f, rl = fleet
    # the trainer resends each call well within the store's patience, as it does by default (5 s
    # against 15 s): a resend that waited on a claim the store refused must hear that refusal
    monkeypatch.setattr(rl, "attempt_s", PATIENCE_S * 0.43)
    assert f.controller is not None
    v1 = new_version("before-quorum-loss")
    await rl.push_weights(trained(91), v1)
    seq = (await rl.get_weight_version_info()).seq
    named = trained(92)
    await rl.start_weight_update()
    await rl.update_weights(named)  # every byte sent: only finish is left

    kept = f.controller.nc.connected_url.port
    lost = [n for n in cluster.nodes if n.port != kept]
    async with VersionEvents(rl) as events:
        for node in lost:
            node.kill()
        # every state-changing call at once: each is refused before anything is dispatched
        calls = {
            "pause": lambda: rl.pause("abort"),
            "start_weight_update": lambda: rl.call(StartWeightUpdate(), FleetAck),
            "update_weight_version": lambda: rl.update_weight_version(new_version("never")),
            "finish_weight_update": lambda: rl.call(
                FinishWeightUpdate(weight_version=new_version("never"), checksums=list(rl.push.checksums)), FleetAck
            ),
        }
        refused: dict[str, rlbus.RLBusError] = {}

        async def call(op: str) -> None:
            with pytest.raises(rlbus.RLBusError) as err:
                await calls[op]()
            refused[op] = err.value

        with anyio.fail_after(45):
            async with anyio.create_task_group() as tg:
                for op in calls:
                    tg.start_soon(call, op)
        assert all(_no_quorum(e) for e in refused.values()), {op: (e.code, e.message) for op, e in refused.items()}

        # nothing was dispatched: no worker paused or renamed or committed, the session is still open
        for wid, w in f.workers.items():
            state = w.state()
            assert state.weight_version == v1 and not state.paused and state.session_id is not None, wid
        assert f.controller.version.version == v1 and f.controller.updates.session_id is not None

        for node in lost:  # back on their ports, with their stores: the stream regains its quorum
            node.start_again()
        await eventually(
            lambda: all(wid in f.controller.registry for wid in WORKERS) and not f.controller.lease_lost,
            timeout=30,
            what="every worker registered with the same controller",
        )
        await eventually(
            lambda: _has_leader(f.controller.nc, rl.subjects.kv_stream),
            timeout=30,
            interval=0.1,
            what="the state stream elected a leader again",
        )
        for bucket in (rl.subjects.kv_bucket, rl.subjects.replies_bucket):  # each stream elects its own leader
            await eventually(
                lambda bucket=bucket: takes_writes(f.controller.nc, bucket),
                timeout=30,
                interval=0.1,
                what=f"{bucket} takes writes again",
            )
        info = await rl.get_weight_version_info()
        assert (info.version, info.seq) == (v1, seq), "the version survived the quorum loss"
        assert events.seen == [], "nothing was published without quorum"

        v2 = new_version("after-quorum-loss")
        with anyio.fail_after(60):
            done = await rl.finish_weight_update(v2)
        assert done.weight_version == v2
        assert await events.wait_for(1) == [v2]
    info = await rl.get_weight_version_info()
    assert (info.version, info.seq) == (v2, seq + 1)
    for wid in WORKERS:
        assert_holds(f, wid, named)
    assert [e.version for e in events.seen] == [v2]


async def test_a_bucket_the_cluster_cannot_place_fails_with_the_servers_refusal(fleet, prefix):
    """A create the cluster refuses to place ("no suitable peers for placement": here 5 replicas
    asked of 3 nodes; also what a just-elected meta leader answers for a while) is retried for
    the patience, then reported in the server's words, not as the bucket missing that followed it
    (a fresh cluster behind proxies once failed a controller's start with a bare
    BucketNotFoundError after 30 s)."""
    f, _ = fleet
    assert f.controller is not None
    nc = f.controller.nc
    await eventually(
        lambda: takes_writes(nc, Subjects(prefix=prefix).kv_bucket), timeout=30, what="the cluster takes writes"
    )

    async def meta_answers() -> bool:  # after the quorum test's kills the meta leader may still be electing
        try:
            await nc.jetstream(timeout=1.0).account_info()
        except Exception:
            return False
        return True

    await eventually(meta_answers, timeout=30, what="JetStream's meta leader answers")
    config = KeyValueConfig(bucket=f"{prefix}_unplaceable", replicas=5, storage=StorageType.FILE)
    with pytest.raises(BadRequestError, match="no suitable peers for placement"):
        await _open_bucket(nc, config, patience_s=3.0)  # a timeout on the way is retried; the refusal is what stays
