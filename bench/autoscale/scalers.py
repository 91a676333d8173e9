"""The scalers the simulation compares, each deciding from what it could observe.

- Tandem: tandem.operator.policy.decide, every 15 s, on a 60 s window of the pods' metrics
  (the operator's defaults), exactly as the operator calls it.
- HPAs on a Pods metric (autoscale.hpa: the controller's algorithm at its default behavior),
  every 15 s, on each pod's mean of the last 60 s (a Prometheus adapter's avg_over_time[1m]):
  running requests, batch fill, `tandem_capacity_utilization` (the pods' own gauge, over the
  server's 60 s window), or GPU utilisation as DCGM reports it.
- KEDA, Prometheus trigger on the waiting requests (sum over pods of their 60 s mean), an
  AverageValue target per pod, feeding the HPA it creates.
- Knative-like: the KPA's decider (pkg/autoscaler/scaling/autoscaler.go), every 2 s, on the
  in-flight requests (running + queued) of the ready pods.

A pod that is not ready reports nothing: it is missing to the HPA and not counted by the KPA.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from itertools import islice

import numpy as np

from tandem.bench.autoscale.hpa import (
    SYNC_PERIOD_S,
    HorizontalPodAutoscaler,
    Keda,
    KedaScaler,
    pods_metric_replicas,
)
from tandem.bench.autoscale.pods import TTFT_BUCKETS, Snapshot
from tandem.operator.bursts import Bursts
from tandem.operator.histogram import histogram_quantile
from tandem.operator.policy import MetricsWindow, ScalingState, ScalingTargets, batch_fill, decide


class Scaler:
    name = ""
    interval_s = 15.0

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        raise NotImplementedError


def _last(history: deque[Snapshot], seconds: float) -> list[Snapshot]:
    """The snapshots of the last `seconds` (one a second), oldest first."""
    return list(islice(reversed(history), int(seconds)))[::-1]


class TandemScaler(Scaler):
    name = "tandem"

    def __init__(
        self,
        targets: ScalingTargets,
        price_per_gpu_hour: float,
        window_s: float = 60.0,
    ) -> None:
        self.targets = targets
        self.price = price_per_gpu_hour
        self.window_s = window_s
        self.state: ScalingState | None = None
        self.last_reasons: list[str] = []
        # what an operator that ran before kept in status.learnedBursts, and how long before this
        # trace's second 0 its clock began (every trace counts its seconds from 0)
        self.learned_status: dict | None = None
        self.clock_offset_s = 0.0

    def remember(self, status: dict, day_s: float) -> None:
        """Begin as an operator that wrote `status` (status.learnedBursts) `day_s` before this
        trace's second 0: the policy takes it back as the operator does on its first decision."""
        self.learned_status, self.clock_offset_s = status, day_s

    def window(self, history: deque[Snapshot]) -> MetricsWindow | None:
        # The operator only sees pods that are ready now; seconds before they were ready count as
        # missing for them, so use the seconds with the current set of ready pods.
        recent = _last(history, self.window_s)
        ready = recent[-1].ready
        seen = [s for s in recent if s.ready == ready]
        if ready == 0 or not seen:
            return None
        tokens_per_s = sum(s.tokens for s in seen) / len(seen)
        cumulative = np.cumsum(np.sum([s.ttft_buckets for s in seen], axis=0))
        cost = self.price * ready / (tokens_per_s * 3600) * 1e6 if tokens_per_s > 0 else None
        # as the operator's window: the capacity gauges' mean per reporting pod times pods, the
        # TTFT histogram's count rate, the slope of the waiting gauge between first and last scrape
        per_pod = [s.capacity / s.capacity_pods for s in seen if s.capacity_pods]
        capacity = ready * sum(per_pod) / len(per_pod) if per_pod else None
        growth = (
            (seen[-1].waiting - seen[0].waiting) / (seen[-1].time - seen[0].time) if len(seen) > 1 else None
        )
        newest = seen[-int(self.interval_s) :]  # the operator's newest scrape interval
        # pods ready a scrape interval ago: the operator's rates count pods with two scrapes
        counted = min(s.ready for s in recent[-int(self.interval_s) - 1 :])
        return MetricsWindow(
            observed_at=recent[-1].time + self.clock_offset_s,
            pods=ready,
            requests_running=sum(s.running for s in seen) / len(seen),
            requests_waiting=sum(s.waiting for s in seen) / len(seen),
            idle_fraction=sum(s.idle for s in seen) / len(seen),
            kv_cache_usage=sum(s.kv_usage for s in seen) / len(seen),
            ttft_p95_s=histogram_quantile(0.95, TTFT_BUCKETS, cumulative),
            tokens_per_s=tokens_per_s,
            cost_per_mtok_usd=cost,
            capacity_tokens_per_s=capacity,
            admitted_per_s=float(cumulative[-1]) / len(seen),
            waiting_growth_per_s=growth,
            recent_tokens_per_s=sum(s.tokens for s in newest) / len(newest),
            counted_pods=counted,
        )

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        ready = history[-1].ready
        now += self.clock_offset_s
        if self.state is None:  # the operator's first decision (scaler._first_state)
            self.state = ScalingState(replicas, ready, bursts=Bursts.from_status(self.learned_status, now))
        self.state = replace(self.state, current_replicas=replicas, ready_replicas=ready)
        d = decide(self.window(history), self.targets, self.state, now, stale_after_s=60)
        self.state = d.state
        if d.action != "Hold":
            self.last_reasons.append(d.reason)
        return d.replicas


# A pod's value of a Pods metric in one second (the snapshot sums or averages over ready pods);
# None where the pods export no value that second.
PodMetric = Callable[[Snapshot, ScalingTargets], float | None]


def running_per_pod(s: Snapshot, _: ScalingTargets) -> float:
    return s.running / s.ready


def batch_fill_per_pod(s: Snapshot, targets: ScalingTargets) -> float:
    # Tandem's own signal: the larger of KV-cache usage and running / max_num_seqs
    window = MetricsWindow(s.time, s.ready, s.running, s.waiting, kv_cache_usage=s.kv_usage)
    return batch_fill(window, targets)


def capacity_utilization_per_pod(s: Snapshot, _: ScalingTargets) -> float | None:
    # `tandem_capacity_utilization`: generated tokens/s over the pod's capacity gauge; the pods of a
    # snapshot share the load evenly, so their mean is the ratio of the sums. Pods that report no
    # capacity yet export no value (None: the second is left out).
    return s.capacity_tokens / s.capacity if s.capacity_pods else None


def gpu_util_per_pod(s: Snapshot, _: ScalingTargets) -> float:
    return s.util


class MetricHPA(Scaler):
    """An HPA on one Pods metric with an AverageValue (or utilisation) target."""

    def __init__(
        self,
        name: str,
        metric: PodMetric,
        target: float,
        min_replicas: int,
        max_replicas: int,
        window_s: float = 60.0,
        max_num_seqs: int = 256,
    ) -> None:
        self.name, self.metric, self.target, self.window_s = name, metric, target, window_s
        self.hpa = HorizontalPodAutoscaler(min_replicas, max_replicas)
        self.targets = ScalingTargets(max_num_seqs=max_num_seqs)
        self.interval_s = SYNC_PERIOD_S

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        reporting = history[-1].ready
        values = [self.metric(s, self.targets) for s in _last(history, self.window_s) if s.ready > 0]
        seen = [v for v in values if v is not None]
        if reporting == 0 or not seen:
            return replicas  # no metrics: the HPA does not act
        mean = sum(seen) / len(seen)
        missing = max(replicas - reporting, 0)
        raw = pods_metric_replicas(replicas, mean, reporting, missing, self.target)
        return self.hpa.normalize(now, replicas, raw)


class KedaQueue(Scaler):
    """KEDA, Prometheus trigger `sum(avg_over_time(tandem_requests_waiting[1m]))`, AverageValue."""

    def __init__(
        self, target: float, min_replicas: int, max_replicas: int, window_s: float = 60.0, **keda: float
    ) -> None:
        self.name = "keda_queue"
        self.window_s = window_s
        self.keda = KedaScaler(Keda(min_replicas, **keda), max_replicas, target)
        self.interval_s = SYNC_PERIOD_S

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        seen = _last(history, self.window_s)
        total = sum(s.waiting for s in seen) / len(seen)
        return self.keda(now, replicas, total)


class KnativeLike(Scaler):
    """The KPA's decider: desired = ceil(concurrency / target) over a stable (60 s) and a panic
    (6 s) window; panic when the panic count reaches 2x the ready pods, and while panicking (until
    a stable window passes below that) never scale down; per tick at most 1000x up, 1/2 down."""

    interval_s = 2.0

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        target: float = 70.0,
        stable_s: float = 60.0,
        panic_s: float = 6.0,
        panic_threshold: float = 2.0,
        max_scale_up_rate: float = 1000.0,
        max_scale_down_rate: float = 2.0,
    ) -> None:
        self.name = "knative_concurrency"
        self.min, self.max, self.target = min_replicas, max_replicas, target
        self.stable_s, self.panic_s, self.panic_threshold = stable_s, panic_s, panic_threshold
        self.up_rate, self.down_rate = max_scale_up_rate, max_scale_down_rate
        self.panic_since: float | None = None  # last time over the panic threshold
        self.max_panic_pods = 0
        self.inflight: deque[float] = deque(maxlen=int(stable_s))
        self.seen = -math.inf

    def decide(self, now: float, ready: int, stable: float, panic: float) -> int:
        """The desired pods for the windows' mean concurrency (all pods together)."""
        pods = max(1.0, float(ready))
        max_up, max_down = math.ceil(self.up_rate * pods), math.floor(pods / self.down_rate)
        dspc, dppc = math.ceil(stable / self.target), math.ceil(panic / self.target)
        desired_stable = min(max(dspc, max_down), max_up)
        desired_panic = min(max(dppc, max_down), max_up)
        over = dppc / pods >= self.panic_threshold
        if over:
            self.panic_since = now
        elif self.panic_since is not None and self.panic_since + self.stable_s < now:
            self.panic_since, self.max_panic_pods = None, 0
        desired = desired_stable
        if self.panic_since is not None:
            self.max_panic_pods = max(self.max_panic_pods, desired_stable, desired_panic)
            desired = self.max_panic_pods
        return max(self.min, min(self.max, desired))

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        # in-flight requests per second, kept here: this runs every 2 s over a 60 s window
        new = [s for s in islice(reversed(history), int(self.interval_s) + 1) if s.time > self.seen]
        for s in reversed(new):
            self.inflight.append(s.running + s.waiting)
        self.seen = history[-1].time
        values = self.inflight
        panic = list(islice(reversed(values), int(self.panic_s)))
        stable = sum(values) / len(values)
        return self.decide(now, history[-1].ready, stable, sum(panic) / len(panic))
