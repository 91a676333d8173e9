"""The Kubernetes HorizontalPodAutoscaler's algorithm (autoscaling/v2 at its default behavior), and
KEDA's layer over it, as the controllers run them (replica_calculator.go, horizontal.go; KEDA's
ScaledObject with a Prometheus trigger).

Every sync period (15 s):
1. A raw recommendation from the metric:
   - a Pods metric with an AverageValue target: ratio = mean over the pods that report / target;
     within the 10% tolerance, keep the current count, else ceil(ratio x reporting pods). Pods
     that do not report yet (starting) count as using nothing when the ratio says up and exactly
     the target when it says down; if that lands within tolerance or flips the direction, keep.
   - an External metric with an AverageValue target (what KEDA's Prometheus scaler makes):
     ratio = total / (target x current pods); within tolerance keep, else ceil(total / target).
2. Stabilisation: no higher than the highest raw recommendation of the last 300 s (scale-down
   window) and no lower than the lowest of the scale-up window (0 s: none).
3. Rate limits: up by at most max(100%, 4 pods) per 15 s; down by at most 100% per 15 s.
4. minReplicas / maxReplicas.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

TOLERANCE = 0.1
SYNC_PERIOD_S = 15.0


@dataclass(frozen=True)
class Behavior:
    """spec.behavior, the defaults of the HPA documentation."""

    scale_down_window_s: float = 300.0
    scale_up_window_s: float = 0.0
    up_percent: float = 100.0  # per period
    up_pods: int = 4  # per period
    down_percent: float = 100.0  # per period
    period_s: float = 15.0


def pods_metric_replicas(
    current: int, mean_per_pod: float, reporting: int, missing: int, target: float
) -> int:
    """The raw recommendation for a Pods metric (AverageValue target), with missing pods."""
    ratio = mean_per_pod / target
    if missing == 0:
        if abs(1.0 - ratio) <= TOLERANCE:
            return current
        return math.ceil(ratio * reporting)
    assumed = target if ratio < 1.0 else 0.0  # on a scale-up, missing pods use nothing
    new_ratio = (mean_per_pod * reporting + assumed * missing) / (target * (reporting + missing))
    if abs(1.0 - new_ratio) <= TOLERANCE or (ratio < 1.0 < new_ratio) or (ratio > 1.0 > new_ratio):
        return current
    wanted = math.ceil(new_ratio * (reporting + missing))
    if (new_ratio < 1.0 and wanted > current) or (new_ratio > 1.0 and wanted < current):
        return current
    return wanted


def external_metric_replicas(current: int, total: float, target_per_pod: float) -> int:
    """The raw recommendation for an External metric with an AverageValue target."""
    if current > 0 and abs(1.0 - total / (target_per_pod * current)) <= TOLERANCE:
        return current
    return math.ceil(total / target_per_pod)


class HorizontalPodAutoscaler:
    """Steps 2-4: stabilisation, rate limits, bounds; keeps the recommendations and events."""

    def __init__(self, min_replicas: int, max_replicas: int, behavior: Behavior = Behavior()) -> None:
        self.min, self.max, self.behavior = min_replicas, max_replicas, behavior
        self.recommendations: deque[tuple[float, int]] = deque()
        self.events: deque[tuple[float, int]] = deque()  # (time, replicas added (+) or removed (-))

    def normalize(self, now: float, current: int, raw: int) -> int:
        """The replica count the HPA sets for the raw recommendation `raw`."""
        b = self.behavior
        if current < self.min or current > self.max:  # bounds first, whatever the metric says
            return max(self.min, min(self.max, current))
        horizon = max(b.scale_down_window_s, b.scale_up_window_s, b.period_s)
        while self.recommendations and self.recommendations[0][0] <= now - horizon:
            self.recommendations.popleft()
        up = min([raw] + [r for t, r in self.recommendations if t > now - b.scale_up_window_s])
        down = max([raw] + [r for t, r in self.recommendations if t > now - b.scale_down_window_s])
        self.recommendations.append((now, raw))
        wanted = min(max(current, up), down)

        while self.events and self.events[0][0] <= now - b.period_s:
            self.events.popleft()
        added = sum(n for _, n in self.events if n > 0)
        removed = -sum(n for _, n in self.events if n < 0)
        start = current - added + removed  # the count at the start of the period
        if wanted > current:
            limit = max(math.ceil(start * (1 + b.up_percent / 100)), start + b.up_pods)
            wanted = min(wanted, max(limit, current), self.max)
        elif wanted < current:
            limit = math.floor(start * (1 - b.down_percent / 100))
            wanted = max(wanted, min(limit, current), self.min)
        wanted = max(self.min, min(self.max, wanted))
        if wanted != current:
            self.events.append((now, wanted - current))
        return wanted


@dataclass(frozen=True)
class Keda:
    """A ScaledObject's own settings around the HPA it creates."""

    min_replica_count: int
    activation_threshold: float = 0.0
    cooldown_s: float = 300.0  # before 1 -> 0, after the trigger was last active
    polling_s: float = 30.0  # how often KEDA itself checks activity


class KedaScaler:
    """KEDA's activation phase (0 <-> 1, KEDA itself) over the HPA's scaling phase (1 <-> N).

    With minReplicaCount >= 1 the trigger counts as always active and the activation threshold
    is ignored (KEDA's documented behaviour); cooldownPeriod then does nothing either: 1 <-> N is
    the HPA's, with its own stabilisation."""

    def __init__(self, keda: Keda, max_replicas: int, target_per_pod: float) -> None:
        self.keda, self.target = keda, target_per_pod
        self.hpa = HorizontalPodAutoscaler(max(keda.min_replica_count, 1), max_replicas)
        self.active = False  # the trigger's state at KEDA's last poll
        self.last_active: float | None = None
        self.last_poll = -math.inf

    def __call__(self, now: float, current: int, total: float) -> int:
        k = self.keda
        if k.min_replica_count == 0:
            if now - self.last_poll >= k.polling_s:
                self.last_poll = now
                self.active = total > k.activation_threshold
                if self.active:
                    self.last_active = now
            if current == 0:
                return 1 if self.active else 0
            cooled = self.last_active is None or now - self.last_active >= k.cooldown_s
            if not self.active and cooled:
                return 0
        if current == 0:  # the HPA does not act on a workload scaled to zero
            return current
        raw = external_metric_replicas(current, total, self.target)
        return self.hpa.normalize(now, current, raw)
