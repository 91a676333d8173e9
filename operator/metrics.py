"""The operator's own Prometheus metrics: its decisions, failed scrapes, tick and reconcile times,
the replicas of each ModelServer, what its policy learned about bursts, and whether this replica
leads; served on GET /metrics.

One registry per operator (tests run several in one process). Label values are bounded: a
ModelServer's namespace and name (its series go when it is deleted), and words of fixed sets
(actions, reasons, problem kinds, modes); anything else is counted as `Other`, never passed on.
No pod names: pods come and go with every scale-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder

from .modes import EXTERNAL, EXTERNAL_SCALER, OPERATOR
from .scrape import PROBLEM_KINDS

log = logging.getLogger("tandem.operator.metrics")
PREFIX = "tandem_operator"
ACTIONS = frozenset({"ScaleUp", "ScaleDown", "Hold"})
# Every reason of policy.decide (tests/test_operator_own_metrics.py reads them from policy.py), and
# the one of scaling mode External.
REASONS = frozenset(
    {
        "AboveMaximum",
        "BelowMinimum",
        "BurstHeadroom",
        "CostAboveCeiling",
        "CostCeilingUnreachable",
        "MetricsMissing",
        "MetricsStale",
        "PodsNotReady",
        "Saturated",
        "SpareCapacity",
        "Stabilizing",
        "Underused",
        "WithinTargets",
        EXTERNAL_SCALER,
    }
)
MODES = frozenset({OPERATOR, EXTERNAL})
RESULTS = frozenset({"Reconciled", "InvalidSpec", "NotOwned", "Error"})
OTHER = "Other"
# A tick scrapes every ready pod within the scrape timeout (5 s by default), then writes.
TICK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PROBLEMS = frozenset(PROBLEM_KINDS)
MODELSERVER = ("namespace", "modelserver")
M = TypeVar("M", Counter, Gauge)


def _word(value: str, allowed: frozenset[str]) -> str:
    return value if value in allowed else OTHER


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(
            f"{PREFIX}_decisions",
            "Scaling decisions (one per tick, Hold included), by action and reason.",
            [*MODELSERVER, "action", "reason"],
            registry=r,
        )
        self.scrape_failures = Counter(
            f"{PREFIX}_scrape_failures",
            "Ready pods whose /metrics could not be used in a tick, by kind of problem.",
            [*MODELSERVER, "problem"],
            registry=r,
        )
        self.tick_seconds = Histogram(
            f"{PREFIX}_tick_duration_seconds",
            "Time of one scaling tick of one ModelServer (scrapes, decision, writes), by scaling mode.",
            ["mode"],
            buckets=TICK_BUCKETS,
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            f"{PREFIX}_reconcile_duration_seconds",
            "Time of one reconcile of a ModelServer's Deployment, Service and PDB, by result.",
            ["result"],
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.replicas = Gauge(
            f"{PREFIX}_replicas", "Replicas of the ModelServer's Deployment.", MODELSERVER, registry=r
        )
        self.desired = Gauge(
            f"{PREFIX}_desired_replicas",
            "Replicas the last decision asked for (status.desiredReplicas).",
            MODELSERVER,
            registry=r,
        )
        self.ready = Gauge(
            f"{PREFIX}_ready_replicas", "Ready pods of the ModelServer.", MODELSERVER, registry=r
        )
        self.burst_growth = Gauge(
            f"{PREFIX}_burst_growth_ratio",
            "Growth of the load within one pod start the policy learned (1: none).",
            MODELSERVER,
            registry=r,
        )
        self.burst_headroom = Gauge(
            f"{PREFIX}_burst_headroom_replicas",
            "Pods that carry that growth at the saturation line (0: nothing learned, or "
            "spec.scaling.burstHeadroom off).",
            MODELSERVER,
            registry=r,
        )
        self.pod_start = Gauge(
            f"{PREFIX}_pod_start_seconds",
            "Seconds from a scale-up to its pods ready, as measured (spec.scaling.podStartSeconds "
            "until one is).",
            MODELSERVER,
            registry=r,
        )
        self.leader = Gauge(
            f"{PREFIX}_leader",
            "1 while this replica acts (holds the leader Lease, or runs without election), else 0.",
            registry=r,
        )
        # label values per ModelServer, to remove its series when it is deleted
        self._series: dict[tuple[str, str], set[tuple[Counter | Gauge, tuple[str, ...]]]] = {}

    def _child(self, metric: M, namespace: str, name: str, *more: str) -> M:
        values = (namespace, name, *more)
        self._series.setdefault((namespace, name), set()).add((metric, values))
        return metric.labels(*values)

    def decided(self, namespace: str, name: str, action: str, reason: str) -> None:
        labels = (_word(action, ACTIONS), _word(reason, REASONS))
        self._child(self.decisions, namespace, name, *labels).inc()

    def scrape_failed(self, namespace: str, name: str, kind: str) -> None:
        self._child(self.scrape_failures, namespace, name, _word(kind, PROBLEMS)).inc()

    def observed(self, namespace: str, name: str, replicas: int, desired: int, ready: int) -> None:
        for gauge, value in ((self.replicas, replicas), (self.desired, desired), (self.ready, ready)):
            self._child(gauge, namespace, name).set(value)

    def learned(self, namespace: str, name: str, growth: float, headroom: int, start_s: float) -> None:
        """What the policy learned about bursts, after a decision."""
        for gauge, value in (
            (self.burst_growth, growth),
            (self.burst_headroom, headroom),
            (self.pod_start, start_s),
        ):
            self._child(gauge, namespace, name).set(value)

    def forget(self, namespace: str, name: str) -> None:
        """A deleted ModelServer's series go: the label sets stay bounded by the live ones."""
        for metric, values in self._series.pop((namespace, name), set()):
            metric.remove(*values)

    def tick(self, mode: str) -> AbstractContextManager:
        return self.tick_seconds.labels(_word(mode, MODES)).time()

    def reconciled(self, result: str, seconds: float) -> None:
        self.reconcile_seconds.labels(_word(result, RESULTS)).observe(seconds)

    def leading(self, leading: Callable[[], bool] | None) -> None:
        """The leader gauge reads `leading()` at each scrape; None = no election, always 1."""
        self.leader.set_function(lambda: 1.0 if leading is None or leading() else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsPortError(RuntimeError):
    """The /metrics port cannot be served (taken, or not allowed)."""


async def serve(metrics: OperatorMetrics, port: int) -> web.AppRunner:
    """GET /metrics on all addresses of `port`, in the operator's event loop (no thread); the
    Prometheus text format, or OpenMetrics when the Accept header asks for it."""

    async def handle(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(metrics.registry), headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "0.0.0.0", port).start()
    except OSError as exc:
        await runner.cleanup()
        raise MetricsPortError(f"cannot serve /metrics on port {port}: {exc}") from exc
    log.info(f"the operator's metrics: http://0.0.0.0:{port}/metrics")
    return runner
