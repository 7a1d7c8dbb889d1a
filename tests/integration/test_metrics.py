"""Prometheus metrics scraped over HTTP from a real fleet: the controller's /metrics move with a
push (durations, bytes, commits, committed seq), and a worker's /metrics name what it holds."""

from __future__ import annotations

import urllib.request

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rlbus.schemas import Subjects
from rlbus.services.controller.service import ControllerOptions
from rlbus.services.metrics import MetricsServer, WorkerMetrics
from rlbus.services.worker.reference_engine import ReferenceEngine
from rlbus.services.worker.service import WorkerOptions

from rlbus.runners.local import LocalFleet
from rlbus.sdk.client import RLClient
from tests.weights_helpers import MODEL, new_version, trained

WORKERS = ("m0", "m1")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at http://127.0.0.1:port/metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
async def metered(nats_server, prefix):
    subjects = Subjects(prefix=prefix + "met")
    fleet = LocalFleet(nats_server.url)
    ctl = await fleet.start_controller(
        ControllerOptions(subjects=subjects, command_timeout_s=10, liveness_timeout_s=1.5, metrics_port=0)
    )
    for wid in WORKERS:
        await fleet.start_worker(
            ReferenceEngine(MODEL),
            WorkerOptions(worker_id=wid, subjects=subjects, heartbeat_s=0.25, weight_transfer_backend="gloo"),
        )
    await fleet.wait_for_workers(WORKERS)
    worker_http = MetricsServer(WorkerMetrics(fleet.workers["m0"].state).registry, 0, addr="127.0.0.1")
    rl = await RLClient.connect(nats_server.url, prefix=prefix + "met", timeout=30.0)
    try:
        assert ctl.metrics_server is not None
        yield ctl.metrics_server.port, worker_http.port, rl
    finally:
        worker_http.close()
        await rl.close()
        await fleet.close()


async def test_controller_metrics_move_with_a_push(metered):
    port, _, rl = metered
    before = await anyio.to_thread.run_sync(scrape, port)
    assert value(before, "rlbus_controller_leading") == 1.0
    assert value(before, "rlbus_workers", state="registered") == len(WORKERS)

    named = trained(5)
    ack = await rl.push_weights(named, new_version("metrics"))

    after = await anyio.to_thread.run_sync(scrape, port)
    dense_bytes = sum(t.numel() * t.element_size() for _, t in named)
    assert (
        value(after, "rlbus_weight_bytes_sent_total", encoding="dense")
        - value(before, "rlbus_weight_bytes_sent_total", encoding="dense")
        == dense_bytes
    )
    assert value(after, "rlbus_commits_total", target="main") == value(before, "rlbus_commits_total", target="main") + 1
    assert (
        value(after, "rlbus_push_duration_seconds_count", target="main", outcome="committed")
        == value(before, "rlbus_push_duration_seconds_count", target="main", outcome="committed") + 1
    )
    assert value(after, "rlbus_control_command_duration_seconds_count", op="finish_weight_update", outcome="ok") >= 1
    seq = value(after, "rlbus_committed_seq", target="main")
    assert seq == value(before, "rlbus_committed_seq", target="main") + 1
    for w in ack.workers:
        assert value(after, "rlbus_worker_behind_seqs", worker=w.worker_id) == 0
        assert value(after, "rlbus_worker_ack_duration_seconds_count", op="commit", worker=w.worker_id) >= 1
    slowest = [
        labels for (name, labels) in after if name == "rlbus_fanout_slowest_ack_seconds" and ("op", "commit") in labels
    ]
    assert len(slowest) == 1 and dict(slowest[0])["worker"] in WORKERS  # the slowest receiver, by name


async def test_pause_age_is_exported_while_paused(metered):
    port, _, rl = metered
    await rl.pause(mode="abort")
    try:
        paused = await anyio.to_thread.run_sync(scrape, port)
        assert value(paused, "rlbus_fleet_paused_seconds") > 0
    finally:
        await rl.resume()
    resumed = await anyio.to_thread.run_sync(scrape, port)
    assert value(resumed, "rlbus_fleet_paused_seconds") == 0


async def test_worker_metrics_name_the_seq_it_holds(metered):
    port, worker_port, rl = metered
    await rl.push_weights(trained(6), new_version("metrics-w"))
    ctl = await anyio.to_thread.run_sync(scrape, port)
    mine = await anyio.to_thread.run_sync(scrape, worker_port)
    assert value(mine, "rlbus_worker_weight_seq", worker="m0", target="main") == value(
        ctl, "rlbus_committed_seq", target="main"
    )
    assert value(mine, "rlbus_worker_withheld", worker="m0") == 0
    assert value(mine, "rlbus_worker_memory_bytes", part="weights") > 0
