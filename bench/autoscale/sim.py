"""One run: a trace replayed against simulated pods sized by one scaler, and what it cost."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tandem.bench.autoscale.calibration import PodModel, load
from tandem.bench.autoscale.pods import TTFT_BUCKETS, Cluster
from tandem.bench.autoscale.scalers import Scaler, TandemScaler
from tandem.bench.autoscale.trace import Trace
from tandem.operator.histogram import histogram_quantile


@dataclass(frozen=True)
class Setup:
    """What every run shares: the pods (their calibrated speed, price and start), the SLO, the
    bounds of every scaler."""

    pod: PodModel = field(default_factory=load)
    price_per_gpu_hour: float = 3.5
    gpus_per_pod: int = 1
    cold_start_s: float = 120.0  # from asking for a pod to its serving (the report sweeps it)
    ttft_slo_s: float = 1.0
    min_replicas: int = 2
    max_replicas: int = 24  # so that the highest burst of every trace fits (~22 pods of chat)
    start_replicas: int = 2
    # Tandem's costCeilingPerMillionTokensUsd; the CRD's default is none (only for --one runs)
    tandem_cost_ceiling: float | None = None
    # what the pods' capacity gauge reads against their true capacity (1 = exact; on an H200,
    # 0.83 of what 256 streams reached: docs/autoscaling.md)
    capacity_bias: float = 1.0
    tandem_burst_headroom: bool = True  # Tandem's scaling.burstHeadroom (the CRD's default: on)
    # Tandem begins the day with what its operator learned the day before and kept in the
    # ModelServer's status.learnedBursts (another day of the same shape, replayed first), as an
    # operator that has run a day does; False: it begins with nothing learned
    tandem_day_before: bool = True
    # Tandem's scaling.scaleDownStabilizationSeconds (None, the CRD's default: derived from the
    # measured start) and, for a derived window, how many starts (None: the policy's own)
    tandem_scale_down_window_s: float | None = None
    tandem_scale_down_window_starts: float | None = None


@dataclass
class Run:
    summary: dict
    pods: np.ndarray  # pods that cost money, per second
    p95_minutes: tuple[np.ndarray, np.ndarray]  # (minutes with requests, their p95 TTFT)


def simulate(trace: Trace, scaler: Scaler, setup: Setup, series: bool = False) -> Run:
    cluster = Cluster(
        setup.start_replicas, setup.cold_start_s, model=setup.pod, capacity_bias=setup.capacity_bias
    )
    history: deque = deque(maxlen=900)
    ttft_seconds: list[list[float]] = []
    pods = np.zeros(trace.seconds, dtype=np.int32)
    pod_seconds = tokens = 0.0
    events = peak = 0
    quarter = (trace.counts / 4).tolist()
    mix = list(zip(trace.prompt_tokens, trace.output_tokens, strict=True))
    interval = int(scaler.interval_s)
    for t in range(trace.seconds):
        n = quarter[t]
        cluster.route(t, [[float(t), n, p, o] for p, o in mix] if n > 0 else [])
        snap = cluster.step(t)
        history.append(snap)
        ttft_seconds.append(snap.ttft_buckets)
        pod_seconds += snap.pods
        peak = max(peak, snap.pods)
        tokens += snap.tokens
        if t > 0 and t % interval == 0:
            wanted = scaler(float(t), cluster.replicas, history)
            if wanted != cluster.replicas:
                events += 1
                cluster.scale(wanted, float(t))
        if series:
            pods[t] = snap.pods
    ttft_minutes = np.add.reduceat(np.array(ttft_seconds), np.arange(0, trace.seconds, 60), axis=0)
    cumulative = np.cumsum(ttft_minutes, axis=1)
    served = cumulative[:, -1] > 0
    p95 = np.array([histogram_quantile(0.95, TTFT_BUCKETS, c) or 0.0 for c in cumulative[served]])
    slo_bucket = int(np.searchsorted(TTFT_BUCKETS, setup.ttft_slo_s))  # the SLO is a bucket bound
    hours = trace.seconds / 3600
    gpu_hours = pod_seconds * setup.gpus_per_pod / 3600
    summary = {
        "scaler": scaler.name,
        "cost_per_million_tokens_usd": round(gpu_hours * setup.price_per_gpu_hour / tokens * 1e6, 4),
        "ttft_p95_slo_attainment": round(float((p95 <= setup.ttft_slo_s).mean()), 4),
        "requests_within_ttft_slo": round(
            float(cumulative[:, slo_bucket].sum() / cumulative[:, -1].sum()), 4
        ),
        "scaling_events_per_hour": round(events / hours, 2),
        "scaling_events": events,
        "gpu_hours": round(gpu_hours, 2),
        "tokens_generated": round(tokens),
        "mean_pods": round(pod_seconds / trace.seconds, 2),
        "peak_pods": int(peak),
        "worst_minute_ttft_p95_s": round(float(p95.max()), 3),
    }
    if isinstance(scaler, TandemScaler):
        reasons = scaler.last_reasons
        summary["decision_reasons"] = {r: reasons.count(r) for r in sorted(set(reasons))}
        # what its burst headroom learned: each hour's highest growth of the load within a pod start
        learned = scaler.state.bursts.growth if scaler.state is not None else ()
        summary["learned_hourly_growth"] = [round(ratio, 3) for _, ratio in learned]
    return Run(summary, pods, (served, p95))
