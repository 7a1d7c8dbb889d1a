from __future__ import annotations

import time

from rlbus.schemas import Capabilities, VersionInfo, WorkerState
from rlbus.services.controller.registry import Registry


def _caps(**kw) -> Capabilities:
    base = dict(
        sleep_mode_enabled=True,
        weight_transfer_backend="gloo",
        has_draft_model=True,
        supports_draft_weight_updates=True,
        model_name="m",
        num_params=10,
    )
    base.update(kw)
    return Capabilities(**base)


def test_capabilities_are_and_aggregated():
    reg = Registry()
    reg.join(_caps(), WorkerState(worker_id="a"))
    reg.join(_caps(sleep_mode_enabled=False, has_draft_model=False), WorkerState(worker_id="b"))
    agg = reg.aggregate()
    assert not agg.sleep_mode_enabled and not agg.has_draft_model
    assert agg.supports_draft_weight_updates and agg.weight_transfer_backend == "gloo"


def test_a_backend_counts_only_when_every_worker_has_the_same_one():
    reg = Registry()
    reg.join(_caps(), WorkerState(worker_id="a"))
    reg.join(_caps(weight_transfer_backend="shm"), WorkerState(worker_id="b"))
    assert reg.aggregate().weight_transfer_backend is None


def test_ranks_follow_a_stable_sorted_order():
    reg = Registry()
    for w in ["w2", "w0", "w1"]:
        reg.join(_caps(), WorkerState(worker_id=w))
    assert reg.ids() == ["w0", "w1", "w2"]
    assert [i.rank for i in reg.infos()] == [0, 1, 2]


def test_a_silent_worker_expires_and_a_beating_one_stays():
    reg = Registry(liveness_timeout_s=1.0)
    reg.join(_caps(), WorkerState(worker_id="a"))
    reg.join(_caps(), WorkerState(worker_id="b"))
    later = time.monotonic() + 5
    reg.get("b").last_seen = later  # b beat recently
    assert reg.expired(now=later + 0.5) == ["a"]


def test_a_heartbeat_from_an_unknown_worker_is_not_registered():
    reg = Registry()
    assert reg.seen(WorkerState(worker_id="ghost")) is False
    assert "ghost" not in reg


def test_stale_workers_are_flagged_against_the_committed_version_and_seq():
    reg = Registry()
    reg.join(_caps(), WorkerState(worker_id="a", weight_version="v2", weight_seq=2))
    reg.join(_caps(), WorkerState(worker_id="b", weight_version="v1", weight_seq=1))
    reg.join(_caps(), WorkerState(worker_id="c", weight_version="v2", weight_seq=1))  # the same string, other bits
    infos = reg.infos(VersionInfo(version="v2", seq=2), quarantined={"c"})
    assert [i.behind for i in infos] == [False, True, True]
    assert [i.quarantined for i in infos] == [False, False, True]
