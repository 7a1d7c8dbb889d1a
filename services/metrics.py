"""Prometheus metrics for the controller and the workers (`--metrics-port`).

Each service owns its own registry (several services may share a process, as in the tests).
What changes with commands (durations, bytes, acks) is recorded as it happens; what the
service already holds (committed seq, each worker's seq, withheld/quarantined workers, pause
age, draft acceptance) is read at scrape time, so nothing is kept twice.

Names follow Prometheus conventions: an `rlbus_` prefix, the unit in the name, `_total` on
counters, histograms for durations.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from rlbus.schemas import FleetEvent, VersionInfo, WorkerState

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class MetricsServer:
    """The HTTP endpoint serving one registry at /metrics (a daemon thread of prometheus_client)."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class ControllerView(Protocol):
    """What the controller's scrape-time collector reads."""

    def metrics_version(self) -> VersionInfo: ...

    def metrics_workers(self) -> list[WorkerState]: ...

    def metrics_leading(self) -> bool: ...

    def metrics_paused_since(self) -> float | None:
        """Wall-clock time the fleet was paused at (the desired state's), or None."""


class ControllerMetrics:
    """Everything `rlbus controller --metrics-port` exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.command_seconds = Histogram(
            "rlbus_control_command_duration_seconds",
            "Time to answer one trainer command (all workers answered).",
            ["op", "outcome"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.push_seconds = Histogram(
            "rlbus_push_duration_seconds",
            "An update session from start_weight_update to its commit or abort.",
            ["target", "outcome"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.bytes_sent = Counter(
            "rlbus_weight_bytes_sent_total",
            "Weight bytes announced by update_weights (what the trainer sends).",
            ["encoding"],
            registry=r,
        )
        self.elements_changed = Counter(
            "rlbus_weight_delta_elements_total",
            "Elements sent in delta-encoded tensors.",
            registry=r,
        )
        self.tensors_sent = Counter(
            "rlbus_weight_tensors_sent_total",
            "Tensors announced by update_weights.",
            ["encoding"],
            registry=r,
        )
        self.commits = Counter("rlbus_commits_total", "Committed update sessions.", ["target"], registry=r)
        self.aborts = Counter("rlbus_session_aborts_total", "Update sessions that ended without a commit.", registry=r)
        self.ack_seconds = LoopHistogram(
            "rlbus_worker_ack_duration_seconds",
            "Time from sending a command to one worker to its answer.",
            ("op", "worker"),
            DURATION_BUCKETS,
        )
        r.register(self.ack_seconds)
        self.slowest = Gauge(
            "rlbus_fanout_slowest_ack_seconds",
            "The slowest worker's answer time in the last fan-out of each op (the label names that worker).",
            ["op", "worker"],
            registry=r,
        )
        self.worker_failures = Counter(
            "rlbus_worker_command_failures_total",
            "Commands a worker refused or did not answer.",
            ["op", "worker", "code"],
            registry=r,
        )
        self._slowest_of: dict[str, str] = {}
        self._started: dict[str, tuple[float, str]] = {}
        self._view: ControllerView | None = None
        r.register(_ControllerState(self))

    def watch(self, view: ControllerView) -> None:
        self._view = view

    # ---- recorded as it happens ----------------------------------------------------------

    def answered(self, op: str, seconds: float, ok: bool) -> None:
        self.command_seconds.labels(op, "ok" if ok else "error").observe(seconds)

    def fanned_out(self, op: str, times: dict[str, float], failures: Iterable[tuple[str, str]]) -> None:
        """One fan-out's per-worker answer times and its failures (worker, code)."""
        observe = self.ack_seconds.observe
        for w, s in times.items():
            observe((op, w), s)
        for w, code in failures:
            self.worker_failures.labels(op, w, code).inc()
        if times:
            worst = max(times, key=times.__getitem__)
            previous = self._slowest_of.get(op)
            if previous is not None and previous != worst:
                self.slowest.remove(op, previous)
            self.slowest.labels(op, worst).set(times[worst])
            self._slowest_of[op] = worst

    def sent(self, params: Iterable[object]) -> None:
        """update_weights announced these ParamMeta (counted once the workers took the command)."""
        for m in params:
            enc = getattr(m, "encoding", "dense")
            self.bytes_sent.labels(enc).inc(getattr(m, "nbytes", 0))
            self.tensors_sent.labels(enc).inc()
            if enc == "delta":
                self.elements_changed.inc(getattr(m, "changed", 0))

    def event(self, ev: FleetEvent) -> None:
        """The controller's own fleet events drive the session clock and the commit counters."""
        now = time.monotonic()
        if ev.event == "session_started" and ev.session_id:
            self._started[ev.session_id] = (now, ev.detail or "main")
        elif ev.event in ("session_committed", "session_aborted") and ev.session_id:
            began = self._started.pop(ev.session_id, None)
            committed = ev.event == "session_committed"
            if committed:
                self.commits.labels(began[1] if began else "main").inc()
            else:
                self.aborts.inc()
            if began:
                self.push_seconds.labels(began[1], "committed" if committed else "aborted").observe(now - began[0])


class LoopHistogram(Collector):
    """A histogram observed only on the service's event loop, and often: a worker's answer time,
    once per worker per fan-out. prometheus_client's Histogram takes a lock per bucket and one for
    the sum on every observe, ~3 us; at 64 workers that was 0.37 ms of a 7.4 ms pause + resume
    round (bench/control.py, patched out in turn). This one keeps each label set's counts in a
    plain list (one bucket found by bisection, two adds) and builds the family at scrape time.
    A scrape runs on the HTTP server's thread: it copies each list at once (atomic under the
    GIL), so a sum may lag its counts by the one observation in flight, never more."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...], buckets: Iterable[float]) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self.bounds = tuple(float(b) for b in buckets)
        self._counts: dict[tuple[str, ...], list[float]] = {}
        """Per label set: one count per bound, one past the last (+Inf), then the sum."""

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self._counts.get(labels)
        if counts is None:
            counts = self._counts[labels] = [0.0] * (len(self.bounds) + 2)
        counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: le is inclusive
        counts[-1] += value

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        les = [floatToGoString(b) for b in (*self.bounds, math.inf)]  # as prometheus_client writes its bounds
        for labels, counts in list(self._counts.items()):
            snap = list(counts)
            total, cumulative = 0.0, []
            for le, n in zip(les, snap[:-1], strict=True):
                total += n
                cumulative.append((le, total))
            family.add_metric(list(labels), cumulative, snap[-1])
        yield family


class _ControllerState(Collector):
    """Read at scrape time from the controller."""

    def __init__(self, m: ControllerMetrics) -> None:
        self._m = m

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        view = self._m._view
        if view is None:
            return
        leading = GaugeMetricFamily("rlbus_controller_leading", "1 while this controller leads the fleet.")
        leading.add_metric([], 1.0 if view.metrics_leading() else 0.0)
        yield leading
        v = view.metrics_version()
        seq = GaugeMetricFamily("rlbus_committed_seq", "Commit sequence of the committed weights.", labels=["target"])
        seq.add_metric(["main"], v.seq)
        seq.add_metric(["draft"], v.draft_seq)
        yield seq
        paused = GaugeMetricFamily("rlbus_fleet_paused_seconds", "How long the fleet has been paused (0: serving).")
        since = view.metrics_paused_since()
        paused.add_metric([], max(0.0, time.time() - since) if since else 0.0)
        yield paused
        yield from _worker_families(view.metrics_workers(), v)


def _worker_families(states: list[WorkerState], v: VersionInfo | None) -> Iterator[Metric]:
    """Per-worker gauges, shared by the controller (every worker) and a worker (itself)."""
    held = GaugeMetricFamily(
        "rlbus_worker_weight_seq", "Commit sequence of the weights a worker holds.", labels=["worker", "target"]
    )
    behind = GaugeMetricFamily(
        "rlbus_worker_behind_seqs", "Commits a worker is behind the committed seq.", labels=["worker"]
    )
    withheld = GaugeMetricFamily(
        "rlbus_worker_withheld", "1 while a worker takes no generation traffic.", labels=["worker"]
    )
    quarantined = GaugeMetricFamily(
        "rlbus_worker_quarantined", "1 while a worker missed a decided commit.", labels=["worker"]
    )
    proposed = CounterMetricFamily(
        "rlbus_draft_tokens_proposed", "Draft tokens proposed (speculative decoding).", labels=["worker"]
    )
    accepted = CounterMetricFamily(
        "rlbus_draft_tokens_accepted", "Draft tokens the verifier accepted.", labels=["worker"]
    )
    ratio = GaugeMetricFamily(
        "rlbus_draft_acceptance_ratio", "Accepted / proposed draft tokens since start.", labels=["worker"]
    )
    counts = GaugeMetricFamily("rlbus_workers", "Workers by state.", labels=["state"])
    n_withheld = n_quarantined = 0
    for s in states:
        held.add_metric([s.worker_id, "main"], s.weight_seq)
        held.add_metric([s.worker_id, "draft"], s.draft_seq)
        if v is not None:
            behind.add_metric([s.worker_id], max(0, v.seq - s.weight_seq))
        withheld.add_metric([s.worker_id], 1.0 if s.withheld else 0.0)
        q = bool(getattr(s, "quarantined", False))
        quarantined.add_metric([s.worker_id], 1.0 if q else 0.0)
        n_withheld += s.withheld
        n_quarantined += q
        proposed.add_metric([s.worker_id], s.spec_proposed)
        accepted.add_metric([s.worker_id], s.spec_accepted)
        if s.spec_proposed:
            ratio.add_metric([s.worker_id], s.spec_accepted / s.spec_proposed)
    counts.add_metric(["registered"], len(states))
    counts.add_metric(["withheld"], n_withheld)
    counts.add_metric(["quarantined"], n_quarantined)
    yield from (held, behind, withheld, quarantined, proposed, accepted, ratio, counts)


class WorkerMetrics:
    """Everything `rlbus worker --metrics-port` exports: read from the worker at scrape time."""

    def __init__(self, state: Callable[[], WorkerState]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_WorkerState(state))


class _WorkerState(Collector):
    def __init__(self, state: Callable[[], WorkerState]) -> None:
        self._state = state

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        s = self._state()
        yield from _worker_families([s], None)
        run = GaugeMetricFamily("rlbus_worker_requests", "Generation requests on this worker.", labels=["state"])
        run.add_metric(["running"], s.in_flight)
        run.add_metric(["waiting"], s.waiting)
        yield run
        paused = GaugeMetricFamily("rlbus_worker_paused", "1 while this worker's engine is paused.")
        paused.add_metric([], 1.0 if s.paused else 0.0)
        yield paused
        mem = GaugeMetricFamily("rlbus_worker_memory_bytes", "Bytes held by the engine.", labels=["part"])
        mem.add_metric(["weights"], s.param_bytes)
        mem.add_metric(["kv_cache"], s.kv_cache_bytes)
        yield mem
