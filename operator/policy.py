"""The scaling policy: a pure function of a metrics window, the targets and the current state.

No I/O and no clock: the caller passes `now`. The operator and the simulation benchmark
(bench/autoscale_sim.py) run this same function.

Signals (DESIGN.md §5): saturation (queue, batch fill = the larger of KV-cache usage and
running/max_num_seqs, p95 time to first token against its target) scales up at once; under-use
(GPU idle fraction high, or cost per million tokens above the ceiling) scales down, slowly, and
only to as many pods as can carry the load with room to spare. In between the policy holds: the
gap between the fill that counts as saturated and the fill a scale-down may leave is the
hysteresis that keeps noisy steady load from flapping.

The SLO beats the cost ceiling: the policy remembers the tokens/s per pod at which the pods last
saturated, and the cost rule never goes below the pods that this rate says the current load needs
(CostCeilingUnreachable). Otherwise a ceiling that the load cannot meet (long prompts, short
answers) scales down, breaks TTFT, scales up, and again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal

# A scale-down must leave the pods at most this share of the saturation fill: after it, load may
# grow by a third before the pods count as saturated again.
SCALE_DOWN_HEADROOM = 0.75
# Scale down only while p95 time to first token is at most this share of its target.
SCALE_DOWN_TTFT_SHARE = 0.8
# Mean queued requests per pod over the window that count as a queue (a request waits for the
# next step's admission for a few milliseconds even on an idle pod).
QUEUE_PER_POD = 1.0
# Metrics come from pods, so any float may arrive: beyond this a value means "more than any
# cluster has" and is treated as this much, which keeps every product and ceil() finite.
HUGE = 1e12
RATIOS = ("idle_fraction", "kv_cache_usage")

Action = Literal["ScaleUp", "ScaleDown", "Hold"]


@dataclass(frozen=True)
class ScalingTargets:
    """The scaling part of a ModelServer spec (names follow the CRD's spec.scaling)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_ttft_s: float = 1.0
    cost_ceiling_usd_per_mtok: float | None = None
    target_batch_fill: float = 0.8
    scale_down_idle_fraction: float = 0.5
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 600.0
    max_scale_up_step: int = 4
    max_scale_down_step: int = 2
    max_num_seqs: int = 256


@dataclass(frozen=True)
class MetricsWindow:
    """What the pods reported over one window. Totals are summed over pods, ratios averaged."""

    observed_at: float  # time of the newest scrape in the window (same clock as `now`)
    pods: int  # pods whose metrics are in the window
    requests_running: float | None  # total, mean over the window
    requests_waiting: float | None  # total, mean over the window
    idle_fraction: float | None = None  # mean over pods
    kv_cache_usage: float | None = None  # mean over pods, 0-1
    ttft_p95_s: float | None = None  # over the window's requests; None when none started
    tokens_per_s: float | None = None  # total
    cost_per_mtok_usd: float | None = None  # all pods' price / all pods' tokens


@dataclass(frozen=True)
class ScalingState:
    """What the policy remembers between calls (kept by the caller, in memory)."""

    current_replicas: int
    ready_replicas: int
    # Raw recommendations of recent calls, oldest first: the stabilisation windows read them.
    recommendations: tuple[tuple[float, int], ...] = ()
    # When the recommendation history began (first call after a start): no scale-down before it
    # covers the whole scale-down window, so an operator restart cannot shrink at once.
    history_since: float | None = None
    # Tokens/s per pod on the first call of the last saturation: what a pod carries at this
    # traffic mix within the SLO, at most (later calls of the same saturation see the backlog
    # drain, not the pods' capacity). Forgotten once pods carry more without saturating.
    saturated_tokens_per_pod: float | None = None
    saturated: bool = False  # whether the last call saw saturation


@dataclass(frozen=True)
class Decision:
    action: Action
    replicas: int
    reason: str  # one CamelCase word, for conditions and events
    message: str  # one sentence for people
    state: ScalingState = field(repr=False)  # feed into the next call (current_replicas updated)


def sanitized(window: MetricsWindow) -> MetricsWindow:
    """The window with every metric a finite number in range: NaN is missing, +Inf and huge values
    are HUGE, negatives 0, ratios within 0-1 (the policy is total: any float in, a decision out)."""
    changes: dict[str, float | None] = {}
    for f in fields(window):
        value = getattr(window, f.name)
        if f.name in ("observed_at", "pods") or value is None:
            continue
        if math.isnan(value):
            changes[f.name] = None
        else:
            changes[f.name] = min(max(value, 0.0), 1.0 if f.name in RATIOS else HUGE)
    return replace(window, **changes)


def _clamp(value: int, targets: ScalingTargets) -> int:
    return max(targets.min_replicas, min(targets.max_replicas, value))


def batch_fill(window: MetricsWindow, targets: ScalingTargets) -> float:
    """How full a pod is on average: the larger of KV-cache usage and running/max_num_seqs."""
    running_share = (window.requests_running or 0.0) / (max(window.pods, 1) * targets.max_num_seqs)
    return max(window.kv_cache_usage or 0.0, running_share)


def _recommend(
    window: MetricsWindow, targets: ScalingTargets, current: int, saturated_per_pod: float | None = None
) -> tuple[int, str, str]:
    """The raw recommendation for this window alone (no stabilisation, no step limits)."""
    fill = batch_fill(window, targets)
    running = window.requests_running or 0.0
    waiting = window.requests_waiting or 0.0
    ratios = {"batch fill": fill / targets.target_batch_fill}
    if waiting >= QUEUE_PER_POD * window.pods:
        ratios["queue"] = (running + waiting) / max(running, 1.0)
    ttft_over = window.ttft_p95_s is not None and window.ttft_p95_s > targets.target_ttft_s
    worst = max(ratios, key=lambda k: ratios[k])
    if ratios[worst] > 1.0 or ttft_over:
        wanted = max(current + 1, math.ceil(current * ratios[worst] - 1e-9))
        what = f"{worst} {ratios[worst]:.2f}x target" if ratios[worst] > 1.0 else ""
        if ttft_over:
            ttft = f"TTFT p95 {window.ttft_p95_s:.2f}s > {targets.target_ttft_s:.2f}s"
            what = f"{ttft}, {what}" if what else ttft
        return wanted, "Saturated", what

    idle = window.idle_fraction
    cost = window.cost_per_mtok_usd
    ceiling = targets.cost_ceiling_usd_per_mtok
    why = []
    if idle is not None and idle >= targets.scale_down_idle_fraction:
        why.append(f"idle {idle:.0%} >= {targets.scale_down_idle_fraction:.0%}")
    if ceiling is not None and cost is not None and cost > ceiling:
        why.append(f"${cost:.3g}/Mtok > ${ceiling:.3g}")
    if not why:
        return current, "WithinTargets", f"batch fill {fill:.0%}, no queue, TTFT within target"
    reason = "Underused" if why[0].startswith("idle") else "CostAboveCeiling"
    # the cost ceiling alone cannot be met without breaking the SLO: hold, and say so
    held = "CostCeilingUnreachable" if reason == "CostAboveCeiling" else reason
    if window.ttft_p95_s is not None and window.ttft_p95_s > SCALE_DOWN_TTFT_SHARE * targets.target_ttft_s:
        return current, held, f"{', '.join(why)}, but TTFT p95 is close to its target"
    carry = math.ceil(current * fill / (targets.target_batch_fill * SCALE_DOWN_HEADROOM) - 1e-9)
    wanted = min(current, max(1, carry))
    if wanted == current:
        return current, held, f"{', '.join(why)}, but fewer pods could not carry batch fill {fill:.0%}"
    tokens = window.tokens_per_s
    if reason == "CostAboveCeiling" and saturated_per_pod and tokens:
        need = math.ceil(tokens / (saturated_per_pod * SCALE_DOWN_HEADROOM) - 1e-9)
        if need >= current:
            return (
                current,
                held,
                (
                    f"{', '.join(why)}, but the pods saturated at {saturated_per_pod:.0f} tokens/s each: "
                    f"the TTFT target needs {need} pods at this load"
                ),
            )
        wanted = max(wanted, need)
    return wanted, reason, f"{', '.join(why)}; {wanted} pods carry batch fill {fill:.0%}"


def _remember_saturation(state: ScalingState, window: MetricsWindow, pods: int, reason: str) -> ScalingState:
    """Keep the tokens/s per pod where a saturation began; forget it once pods carry more
    without saturating."""
    saturated = reason == "Saturated"
    per_pod = window.tokens_per_s / pods if window.tokens_per_s and pods > 0 else None
    remembered = state.saturated_tokens_per_pod
    if saturated and not state.saturated and per_pod is not None:
        remembered = per_pod
    elif not saturated and per_pod is not None and remembered is not None and per_pod > remembered:
        remembered = None
    return replace(state, saturated_tokens_per_pod=remembered, saturated=saturated)


def _hold(state: ScalingState, reason: str, message: str) -> Decision:
    return Decision("Hold", state.current_replicas, reason, message, state)


def decide(
    window: MetricsWindow | None,
    targets: ScalingTargets,
    state: ScalingState,
    now: float,
    stale_after_s: float = 120.0,
) -> Decision:
    """The replica count to run now, with the reason, and the state for the next call."""
    current = state.current_replicas
    bounded = _clamp(current, targets)
    if bounded != current:
        # Bounds hold whatever the metrics say (a spec edit moved them).
        action: Action = "ScaleUp" if bounded > current else "ScaleDown"
        reason = "BelowMinimum" if bounded > current else "AboveMaximum"
        new_state = ScalingState(bounded, state.ready_replicas, (), None)
        bound = "minReplicas" if bounded > current else "maxReplicas"
        return Decision(action, bounded, reason, f"{current} pods is outside {bound} {bounded}", new_state)

    # "not (age <= limit)": a NaN time counts as stale too
    if window is not None and not now - window.observed_at <= stale_after_s:
        age = now - window.observed_at
        return _hold(state, "MetricsStale", f"no pod has answered a scrape for {age:.0f}s")
    window = sanitized(window) if window is not None else None
    if window is None or window.pods == 0 or None in (window.requests_running, window.requests_waiting):
        return _hold(state, "MetricsMissing", "no pod metrics in the window")
    ready = min(state.ready_replicas, current)
    seen = min(ready, window.pods)
    if seen < current:
        # Pods are starting, failing or not reporting: no scale-down, and a scale-up only when the
        # pods that report are saturated beyond what the others will absorb (a long cold start
        # must not stall a burst; the same saturation must not add pods twice).
        if seen > 0:
            raw, reason, message = _recommend(window, targets, seen)
            if reason == "Saturated":
                state = _remember_saturation(state, window, seen, reason)
            target = min(_clamp(raw, targets), current + targets.max_scale_up_step)
            if reason == "Saturated" and target > current:
                note = f"{message} ({current - seen} of {current} pods not ready or not reporting)"
                return Decision("ScaleUp", target, reason, note, replace(state, current_replicas=target))
        if ready < current:
            return _hold(state, "PodsNotReady", f"{ready} of {current} pods ready")
        return _hold(state, "MetricsMissing", f"{current - seen} of {current} ready pods not reporting")

    raw, reason, message = _recommend(window, targets, current, state.saturated_tokens_per_pod)
    state = _remember_saturation(state, window, current, reason)
    raw = _clamp(raw, targets)
    horizon = max(targets.scale_up_stabilization_s, targets.scale_down_stabilization_s)
    history = tuple((t, r) for t, r in state.recommendations if now - t <= horizon) + ((now, raw),)
    since = state.history_since if state.history_since is not None else now
    state = replace(state, recommendations=history, history_since=since)

    if raw > current:
        # Fast up: the lowest recommendation of the (short) up window, so one spike is not enough
        # when that window is set; at most max_scale_up_step pods at once.
        up_window = [r for t, r in history if now - t <= targets.scale_up_stabilization_s]
        target = min(min(up_window), current + targets.max_scale_up_step)
        if target <= current:
            return _hold(state, "Stabilizing", f"{message}; waiting out the scale-up window")
        new_state = replace(state, current_replicas=target)
        return Decision("ScaleUp", target, reason, message, new_state)

    if raw < current:
        # Slow down: only to the highest recommendation of the whole down window, and only once
        # the history covers that window.
        if now - since < targets.scale_down_stabilization_s:
            return _hold(state, "Stabilizing", f"{message}; scale-down window not yet observed")
        down_window = [r for t, r in history if now - t <= targets.scale_down_stabilization_s]
        target = max(max(down_window), current - targets.max_scale_down_step)
        if target >= current:
            return _hold(state, "Stabilizing", f"{message}; higher load within the scale-down window")
        new_state = replace(state, current_replicas=target)
        return Decision("ScaleDown", target, reason, message, new_state)

    return _hold(state, reason, message)
