"""The controller's per-worker answer-time histogram (services/metrics.LoopHistogram) exports
what prometheus_client's own Histogram exports for the same observations."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rlbus.services.metrics import DURATION_BUCKETS, LoopHistogram


def _samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_a_loop_histogram_exports_the_buckets_count_and_sum_a_prometheus_histogram_exports() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop_h = LoopHistogram("ack_seconds", "answer time", ("op", "worker"), DURATION_BUCKETS)
    ours.register(loop_h)
    ref = Histogram("ack_seconds", "answer time", ["op", "worker"], registry=theirs, buckets=DURATION_BUCKETS)
    rng = random.Random(7)
    values = [*DURATION_BUCKETS, 0.0, 1e-9, 500.0, *(rng.lognormvariate(-6, 2) for _ in range(300))]
    for v in values:  # bounds themselves included: le is inclusive
        labels = (rng.choice(["pause", "commit"]), rng.choice(["w0", "w1", "w2"]))
        loop_h.observe(labels, v)
        ref.labels(*labels).observe(v)
    got, want = _samples(ours), _samples(theirs)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_a_loop_histogram_with_no_observation_exports_an_empty_family() -> None:
    registry = CollectorRegistry()
    registry.register(LoopHistogram("ack_seconds", "answer time", ("op",), (0.1, 1.0)))
    assert _samples(registry) == {}
