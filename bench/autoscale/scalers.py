"""The three scalers the simulation compares, each deciding from what it could observe.

- Tandem: tandem.operator.policy.decide, every 15 s, on a 60 s window of the pods' metrics
  (the operator's defaults), exactly as the operator calls it.
- HPA on GPU utilisation, target 70%: Kubernetes' algorithm (ceil(sum of utilisation / target),
  10% tolerance, every 15 s; scale-up at most 100% or 4 pods per period; scale-down to the highest
  recommendation of the last 300 s), on utilisation averaged over 60 s as DCGM reports it.
- Knative-like concurrency target: the KPA (container concurrency target 100 at 70% utilisation
  = 70 in-flight requests per pod; 60 s stable window; 6 s panic window that takes over at 2x;
  every 2 s; scale-down at most by half per tick).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import numpy as np

from autoscale.pods import TTFT_BUCKETS, Snapshot
from tandem.operator.histogram import histogram_quantile
from tandem.operator.policy import MetricsWindow, ScalingState, ScalingTargets, decide


class Scaler:
    name = ""
    interval_s = 15.0

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        raise NotImplementedError


def _last(history: deque[Snapshot], seconds: float) -> list[Snapshot]:
    return [s for s in history if s.time > history[-1].time - seconds]


class TandemScaler(Scaler):
    name = "tandem"

    def __init__(self, targets: ScalingTargets, price_per_gpu_hour: float, window_s: float = 60.0) -> None:
        self.targets = targets
        self.price = price_per_gpu_hour
        self.window_s = window_s
        self.state: ScalingState | None = None
        self.last_reasons: list[str] = []

    def window(self, history: deque[Snapshot]) -> MetricsWindow | None:
        # The operator only sees pods that are ready now; seconds before they were ready count as
        # missing for them, so use the seconds with the current set of ready pods.
        recent = _last(history, self.window_s)
        ready = recent[-1].ready
        seen = [s for s in recent if s.ready == ready]
        if ready == 0 or not seen:
            return None
        tokens_per_s = sum(s.tokens for s in seen) / len(seen)
        cumulative = np.cumsum(sum(s.ttft_buckets for s in seen))
        cost = self.price * ready / (tokens_per_s * 3600) * 1e6 if tokens_per_s > 0 else None
        return MetricsWindow(
            observed_at=recent[-1].time,
            pods=ready,
            requests_running=sum(s.running for s in seen) / len(seen),
            requests_waiting=sum(s.waiting for s in seen) / len(seen),
            idle_fraction=sum(s.idle for s in seen) / len(seen),
            kv_cache_usage=sum(s.kv_usage for s in seen) / len(seen),
            ttft_p95_s=histogram_quantile(0.95, TTFT_BUCKETS, cumulative),
            tokens_per_s=tokens_per_s,
            cost_per_mtok_usd=cost,
        )

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        ready = history[-1].ready
        if self.state is None:
            self.state = ScalingState(replicas, ready)
        self.state = replace(self.state, current_replicas=replicas, ready_replicas=ready)
        d = decide(self.window(history), self.targets, self.state, now, stale_after_s=60)
        self.state = d.state
        if d.action != "Hold":
            self.last_reasons.append(d.reason)
        return d.replicas


class UtilisationHPA(Scaler):
    name = "hpa_gpu_util_70"

    def __init__(self, min_replicas: int, max_replicas: int, target: float = 0.7) -> None:
        self.min, self.max, self.target = min_replicas, max_replicas, target
        self.recommendations: deque[tuple[float, int]] = deque()

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        seen = [s for s in _last(history, 60) if s.ready > 0]
        if not seen:
            return replicas
        ready = seen[-1].ready
        util_sum = ready * sum(s.util for s in seen) / len(seen)
        # pods not ready yet count as 0% busy (Kubernetes does so when scaling up)
        ratio = util_sum / (replicas * self.target)
        raw = replicas if abs(ratio - 1) <= 0.1 else math.ceil(util_sum / self.target)
        raw = max(self.min, min(self.max, raw))
        self.recommendations.append((now, raw))
        while self.recommendations[0][0] < now - 300:
            self.recommendations.popleft()
        if raw > replicas:
            return min(raw, replicas + max(4, replicas))
        return max(min(replicas, max(r for _, r in self.recommendations)), self.min)


class KnativeLike(Scaler):
    name = "knative_concurrency_70"
    interval_s = 2.0

    def __init__(self, min_replicas: int, max_replicas: int, target: float = 70.0) -> None:
        self.min, self.max, self.target = min_replicas, max_replicas, target
        self.panic_until = -1.0

    def __call__(self, now: float, replicas: int, history: deque[Snapshot]) -> int:
        def concurrency(seconds: float) -> float:
            seen = _last(history, seconds)
            return sum(s.running + s.waiting for s in seen) / len(seen)

        stable = math.ceil(concurrency(60) / self.target)
        panic = math.ceil(concurrency(6) / self.target)
        ready = max(history[-1].ready, 1)
        if panic >= 2 * ready:
            self.panic_until = now + 60
        if now < self.panic_until:
            wanted = max(panic, replicas)  # in panic mode Knative never scales down
        else:
            wanted = max(stable, math.ceil(replicas / 2))
        return max(self.min, min(self.max, wanted))
