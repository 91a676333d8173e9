"""The scaling policy: a pure function of a metrics window, the targets and the current state.

No I/O and no clock: the caller passes `now`. The operator and the simulation benchmark
(bench/autoscale_sim.py) run this same function.

Signals (DESIGN.md §5): the pods' capacity utilization (generated tokens/s against what each pod
measured it can generate at its traffic's mix, `tandem_capacity_tokens_per_second`) sizes the
Deployment: the policy runs as many pods as carry the load at `target_utilization`. Saturation
(a queue, batch fill = the larger of KV-cache usage and running/max_num_seqs, utilization beyond
the target's tolerance, p95 time to first token over its target) scales up at once, by the load
offered (served plus the queue's growth and backlog); spare capacity, a high GPU idle fraction or
a cost per million tokens above the ceiling scale down, slowly, and only to as many pods as carry
the load at the target. In between the policy holds: the tolerance above the target before a
scale-up, against none below it, is the hysteresis that keeps noisy steady load from flapping.
Pods that do not report a capacity (an older server) are sized by batch fill alone.

Ahead of bursts (bursts.py): a new pod serves a while after it is asked for, and a burst that
grows faster breaks TTFT before it arrives. The policy learns that start from its own scale-ups
and how much the load grows within it from the load it has seen, and keeps the pods that carry
that growth at the saturation line (BurstHeadroom): it scales up ahead when the pods fall a
tolerance short of them, and never scales down below them. The growth is forgotten after a day,
so calm traffic keeps no headroom.

The SLO beats the cost ceiling: the policy remembers the tokens/s per pod at which the pods last
saturated, and the cost rule never goes below the pods that this rate says the current load needs
(CostCeilingUnreachable). Otherwise a ceiling that the load cannot meet (long prompts, short
answers) scales down, breaks TTFT, scales up, and again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from .bursts import Bursts, Headroom, headroom

# A scale-down must leave the pods at most this share of the saturation fill: after it, load may
# grow by a third before the pods count as saturated again.
SCALE_DOWN_HEADROOM = 0.75
# Utilization this far above its target counts as saturation (a scale-up); below the target a
# smaller count that carries the load at the target is a scale-down. The gap absorbs the noise of
# steady load (a minute's rate moves by several percent) without a decision.
UTILIZATION_TOLERANCE = 0.2
# Under a cost ceiling the pods may be packed this far above the target, never to the tolerance.
COST_PACKING = 0.1
# At most one scale-down per this share of the scale-down window: as load falls after a burst,
# the window's highest recommendation falls tick by tick, and each tick would be a decision.
SCALE_DOWN_PERIOD_SHARE = 0.5
# Without a scale-down window in the spec, the policy holds pods after the load falls for this many
# pod starts (measured from its own scale-ups, else pod_start_s), within these bounds: a pod
# released too early comes back only a start later, so the faster pods start the sooner spare ones
# may go; below the HPA's 300 s the scaling events outgrow the calm target (docs/autoscaling.md,
# "The scale-down window": 12 and 16 starts, 120-600 s and 300-600 s, on two sets of traces).
SCALE_DOWN_WINDOW_STARTS = 16.0
SCALE_DOWN_WINDOW_BOUNDS_S = (300.0, 600.0)
# A queue's backlog is load to serve within this long, on top of the arrivals.
BACKLOG_DRAIN_S = 60.0
# Scale down only while p95 time to first token is at most this share of its target.
SCALE_DOWN_TTFT_SHARE = 0.8
# Mean queued requests per pod over the window that count as a queue (a request waits for the
# next step's admission for a few milliseconds even on an idle pod).
QUEUE_PER_POD = 1.0
# Metrics come from pods, so any float may arrive: beyond this a value means "more than any
# cluster has" and is treated as this much, which keeps every product and ceil() finite.
HUGE = 1e12
RATIOS = ("idle_fraction", "kv_cache_usage")
SIGNED = ("waiting_growth_per_s",)

Action = Literal["ScaleUp", "ScaleDown", "Hold"]


@dataclass(frozen=True)
class ScalingTargets:
    """The scaling part of a ModelServer spec (names follow the CRD's spec.scaling)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_ttft_s: float = 1.0
    cost_ceiling_usd_per_mtok: float | None = None
    target_batch_fill: float = 0.8
    target_utilization: float = 0.7
    scale_down_idle_fraction: float = 0.5
    scale_up_stabilization_s: float = 0.0
    # None: scale_down_window_starts pod starts, within SCALE_DOWN_WINDOW_BOUNDS_S (scale_down_window_s)
    scale_down_stabilization_s: float | None = None
    scale_down_window_starts: float = SCALE_DOWN_WINDOW_STARTS
    max_scale_up_step: int = 4
    max_scale_down_step: int = 2
    max_num_seqs: int = 256
    # how long a new pod takes from a scale-up to serving, until the policy has measured it
    pod_start_s: float = 120.0
    burst_headroom: bool = True  # keep the pods that absorb the load's learned growth (bursts.py)


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
    # what the pods say they could generate at their traffic's mix: mean over the pods that
    # report it, times pods
    capacity_tokens_per_s: float | None = None
    # generated tokens/s over the newest scrape interval only: a burst shows here a window earlier
    recent_tokens_per_s: float | None = None
    admitted_per_s: float | None = None  # requests that got their first token (TTFT count rate)
    waiting_growth_per_s: float | None = None  # slope of requests_waiting over the window
    # pods whose counters span two scrapes of the window (the rates sum over them); None: all
    counted_pods: int | None = None


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
    scaled_down_at: float | None = None  # the last scale-down (SCALE_DOWN_PERIOD_SHARE)
    # the load's growth within a pod start, and the starts measured (bounded: bursts.py)
    bursts: Bursts = field(default_factory=Bursts)


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
        if f.name in ("observed_at", "pods", "counted_pods") or value is None:
            continue
        if math.isnan(value):
            changes[f.name] = None
        elif f.name in SIGNED:
            changes[f.name] = min(max(value, -HUGE), HUGE)
        else:
            changes[f.name] = min(max(value, 0.0), 1.0 if f.name in RATIOS else HUGE)
    return replace(window, **changes)


def _clamp(value: int, targets: ScalingTargets) -> int:
    return max(targets.min_replicas, min(targets.max_replicas, value))


def batch_fill(window: MetricsWindow, targets: ScalingTargets) -> float:
    """How full a pod is on average: the larger of KV-cache usage and running/max_num_seqs."""
    running_share = (window.requests_running or 0.0) / (max(window.pods, 1) * targets.max_num_seqs)
    return max(window.kv_cache_usage or 0.0, running_share)


def utilization(window: MetricsWindow, recent: bool = False) -> float | None:
    """Generated tokens/s over what the pods could generate at their traffic's mix, over the
    window (or the larger of that and the newest scrape interval's); None when unknown."""
    if not window.capacity_tokens_per_s or window.tokens_per_s is None:
        return None
    tokens = window.tokens_per_s
    if recent and window.recent_tokens_per_s is not None:
        tokens = max(tokens, window.recent_tokens_per_s)
    return tokens / window.capacity_tokens_per_s


def offered_share(window: MetricsWindow, backlog: bool = True) -> float | None:
    """Load offered over load served, in requests: admissions plus the queue's growth (plus its
    backlog, to be served within BACKLOG_DRAIN_S), over admissions. None without admissions."""
    admitted = window.admitted_per_s
    if not admitted:
        return None
    growth = max(window.waiting_growth_per_s or 0.0, 0.0)
    drain = (window.requests_waiting or 0.0) / BACKLOG_DRAIN_S if backlog else 0.0
    return (admitted + growth + drain) / admitted


def _recommend(
    window: MetricsWindow,
    targets: ScalingTargets,
    current: int,
    saturated_per_pod: float | None = None,
    starting: bool = False,
) -> tuple[int, str, str]:
    """The raw recommendation for this window alone (no stabilisation, no step limits).
    `starting`: more pods are on their way, and they will serve the backlog that is there now."""
    fill = batch_fill(window, targets)
    util = utilization(window)
    ratios = {"batch fill": fill / targets.target_batch_fill}
    if util is not None:
        # fast up: the newest interval counts too, slow down: the whole window
        ratios["capacity use"] = (
            max(util, utilization(window, recent=True) or 0.0) / targets.target_utilization
        )
    queued = (window.requests_waiting or 0.0) >= QUEUE_PER_POD * window.pods
    ttft_over = window.ttft_p95_s is not None and window.ttft_p95_s > targets.target_ttft_s
    over = ratios["batch fill"] > 1.0 or ratios.get("capacity use", 0.0) > 1.0 + UTILIZATION_TOLERANCE
    if over or queued or ttft_over:
        return _saturated(window, targets, current, ratios, over, queued, ttft_over, starting)
    return _spare(window, targets, current, fill, util, saturated_per_pod)


def _saturated(
    window: MetricsWindow,
    targets: ScalingTargets,
    current: int,
    ratios: dict[str, float],
    over: bool,
    queued: bool,
    ttft_over: bool,
    starting: bool,
) -> tuple[int, str, str]:
    """Scale up at once: by the worst ratio to its target, or by the load offered over the load
    served under a queue; at least one pod more."""
    running = window.requests_running or 0.0
    waiting = window.requests_waiting or 0.0
    worst = max(ratios, key=lambda k: ratios[k])
    size = ratios[worst]
    what = [f"{worst} {ratios[worst]:.2f}x target"] if over else []
    if queued:
        offered = offered_share(window, backlog=not starting)
        if "capacity use" in ratios and offered is not None:
            size = max(size, ratios["capacity use"] * offered)
        else:  # no capacity or no admissions: what is in flight against what runs
            size = max(size, (running + waiting) / max(running, 1.0))
        what.append(f"queue of {waiting:.0f} requests")
    if ttft_over:
        what.append(f"TTFT p95 {window.ttft_p95_s:.2f}s > {targets.target_ttft_s:.2f}s")
    # bounded before rounding: a vanishing admission rate makes the offered share overflow
    wanted = max(current + 1, math.ceil(min(current * size, targets.max_replicas) - 1e-9))
    return wanted, "Saturated", ", ".join(what)


def _spare(
    window: MetricsWindow,
    targets: ScalingTargets,
    current: int,
    fill: float,
    util: float | None,
    saturated_per_pod: float | None,
) -> tuple[int, str, str]:
    """Within the targets: hold, or the fewest pods that carry the load at the target when there is
    spare capacity, idle time or a cost above the ceiling."""
    idle = window.idle_fraction
    cost = window.cost_per_mtok_usd
    ceiling = targets.cost_ceiling_usd_per_mtok
    why: list[tuple[str, str]] = []
    target = targets.target_utilization
    if util is not None and math.ceil(current * util / target - 1e-9) < current:
        why.append(("SpareCapacity", f"capacity use {util:.0%} < target {target:.0%}"))
    if idle is not None and idle >= targets.scale_down_idle_fraction:
        why.append(("Underused", f"idle {idle:.0%} >= {targets.scale_down_idle_fraction:.0%}"))
    if ceiling is not None and cost is not None and cost > ceiling:
        why.append(("CostAboveCeiling", f"${cost:.3g}/Mtok > ${ceiling:.3g}"))
    if not why:
        use = f"capacity use {util:.0%}, " if util is not None else ""
        return current, "WithinTargets", f"{use}batch fill {fill:.0%}, no queue, TTFT within target"
    reason = why[0][0]
    said = ", ".join(w for _, w in why)
    # the cost ceiling alone cannot be met without breaking the SLO: hold, and say so
    held = "CostCeilingUnreachable" if reason == "CostAboveCeiling" else reason
    if window.ttft_p95_s is not None and window.ttft_p95_s > SCALE_DOWN_TTFT_SHARE * targets.target_ttft_s:
        return current, held, f"{said}, but TTFT p95 is close to its target"
    carry = math.ceil(current * fill / (targets.target_batch_fill * SCALE_DOWN_HEADROOM) - 1e-9)
    if util is not None:
        # a ceiling may pack the pods a little beyond the target, never to where they saturate
        pack = target * (1 + (COST_PACKING if reason == "CostAboveCeiling" else 0.0))
        carry = max(carry, math.ceil(current * util / pack - 1e-9))
    wanted = min(current, max(1, carry))
    load = f"capacity use {util:.0%}" if util is not None else f"batch fill {fill:.0%}"
    if wanted == current:
        return current, held, f"{said}, but fewer pods could not carry {load}"
    tokens = window.tokens_per_s
    if reason == "CostAboveCeiling" and saturated_per_pod and tokens:
        need = math.ceil(tokens / (saturated_per_pod * SCALE_DOWN_HEADROOM) - 1e-9)
        if need >= current:
            return (
                current,
                held,
                (
                    f"{said}, but the pods saturated at {saturated_per_pod:.0f} tokens/s each: "
                    f"the TTFT target needs {need} pods at this load"
                ),
            )
        wanted = max(wanted, need)
    return wanted, reason, f"{said}; {wanted} pods carry {load}"


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


def scale_down_window_s(targets: ScalingTargets, state: ScalingState) -> float:
    """The scale-down stabilisation window: the spec's, else as many pod starts as
    `scale_down_window_starts` (the slowest start of the policy's last scale-ups), within bounds."""
    if targets.scale_down_stabilization_s is not None:
        return targets.scale_down_stabilization_s
    low, high = SCALE_DOWN_WINDOW_BOUNDS_S
    starts = targets.scale_down_window_starts * state.bursts.start_s(targets.pod_start_s)
    return min(max(starts, low), high)


def _record(state: ScalingState, now: float, raw: int, targets: ScalingTargets) -> ScalingState:
    """Add a raw recommendation to the history the stabilisation windows read."""
    down = targets.scale_down_stabilization_s
    # a derived window moves with the measured start: keep what its longest could read
    down_horizon = SCALE_DOWN_WINDOW_BOUNDS_S[1] if down is None else down
    horizon = max(targets.scale_up_stabilization_s, down_horizon)
    history = tuple((t, r) for t, r in state.recommendations if now - t <= horizon) + ((now, raw),)
    since = state.history_since if state.history_since is not None else now
    return replace(state, recommendations=history, history_since=since)


def _most_up(current: int, targets: ScalingTargets) -> int:
    """The most pods one scale-up may reach: doubling, or max_scale_up_step more if that is more
    (the HPA's default behaviour; scale-downs likewise halve at most, or max_scale_down_step)."""
    return current + max(targets.max_scale_up_step, current)


def _hold(state: ScalingState, reason: str, message: str) -> Decision:
    return Decision("Hold", state.current_replicas, reason, message, state)


def load_in_pods(window: MetricsWindow) -> float | None:
    """The load offered, in pods' worth of capacity: generated tokens/s, scaled by arrivals over
    admissions (a growing queue adds to it, a draining one takes its backlog out), over one pod's
    capacity. None without a capacity."""
    if not window.capacity_tokens_per_s or window.tokens_per_s is None or window.pods <= 0:
        return None
    tokens = window.tokens_per_s
    if window.admitted_per_s:
        arrivals = window.admitted_per_s + (window.waiting_growth_per_s or 0.0)
        # bounded before the product: a vanishing admission rate must not make 0 x inf
        tokens *= min(max(arrivals, 0.0) / window.admitted_per_s, HUGE)
    return min(tokens * window.pods / window.capacity_tokens_per_s, HUGE)


def burst_headroom(state: ScalingState, targets: ScalingTargets, now: float) -> Headroom | None:
    """The pods that carry the load's learned growth at the saturation line (the target and its
    tolerance); None until a growth is learned."""
    line = targets.target_utilization * (1 + UTILIZATION_TOLERANCE)
    return headroom(state.bursts, now, targets.pod_start_s, line)


def _sample_load(
    state: ScalingState, window: MetricsWindow, targets: ScalingTargets, now: float
) -> ScalingState:
    """Learn from the window's load when it is the whole load: every ready pod reports, with a rate."""
    load = load_in_pods(window)
    counted = window.pods if window.counted_pods is None else window.counted_pods
    if load is None or window.pods < state.ready_replicas or counted < window.pods:
        return state
    bursts = state.bursts
    return replace(state, bursts=bursts.observed(now, load, bursts.start_s(targets.pod_start_s)))


def _ahead(raw: int, reason: str, message: str, current: int, room: Headroom | None) -> tuple[int, str, str]:
    """The recommendation with the burst headroom: up ahead of a burst when the learned growth
    would take the pods a tolerance beyond the saturation line (the hysteresis of the target's own
    rule), never down below the headroom; a saturation scales up to it at least."""
    if room is None or room.pods <= raw:
        return raw, reason, message
    if reason == "Saturated":
        return room.pods, reason, f"{message}; {room.says()}"
    if room.pods > current * (1 + UTILIZATION_TOLERANCE):
        return room.pods, "BurstHeadroom", f"{room.says()}; {message}"
    if raw < current:
        return min(room.pods, current), "BurstHeadroom", f"{message}; but {room.says()}"
    return raw, reason, message


def decide(
    window: MetricsWindow | None,
    targets: ScalingTargets,
    state: ScalingState,
    now: float,
    stale_after_s: float = 120.0,
) -> Decision:
    """The replica count to run now, with the reason, and the state for the next call."""
    state = replace(state, bursts=state.bursts.ready(now, state.ready_replicas))
    d = _decide(window, targets, state, now, stale_after_s)
    bursts = d.state.bursts.scaled(now, state.current_replicas, d.replicas)
    return replace(d, state=replace(d.state, bursts=bursts))


def _decide(
    window: MetricsWindow | None,
    targets: ScalingTargets,
    state: ScalingState,
    now: float,
    stale_after_s: float = 120.0,
) -> Decision:
    """decide() without the bookkeeping of scale-ups and their pods' start."""
    current = state.current_replicas
    bounded = _clamp(current, targets)
    if bounded != current:
        # Bounds hold whatever the metrics say (a spec edit moved them).
        action: Action = "ScaleUp" if bounded > current else "ScaleDown"
        reason = "BelowMinimum" if bounded > current else "AboveMaximum"
        new_state = ScalingState(bounded, state.ready_replicas, (), None, bursts=state.bursts)
        bound = "minReplicas" if bounded > current else "maxReplicas"
        return Decision(action, bounded, reason, f"{current} pods is outside {bound} {bounded}", new_state)

    # "not (age <= limit)": a NaN time counts as stale too
    if window is not None and not now - window.observed_at <= stale_after_s:
        age = now - window.observed_at
        return _hold(state, "MetricsStale", f"no pod has answered a scrape for {age:.0f}s")
    window = sanitized(window) if window is not None else None
    if window is None or window.pods == 0 or None in (window.requests_running, window.requests_waiting):
        return _hold(state, "MetricsMissing", "no pod metrics in the window")
    state = _sample_load(state, window, targets, now)
    ready = min(state.ready_replicas, current)
    seen = min(ready, window.pods)
    if seen < current:
        return _while_pods_missing(window, targets, state, now, ready, seen)

    raw, reason, message = _recommend(window, targets, current, state.saturated_tokens_per_pod)
    state = _remember_saturation(state, window, current, reason)
    if targets.burst_headroom:
        raw, reason, message = _ahead(raw, reason, message, current, burst_headroom(state, targets, now))
    raw = _clamp(raw, targets)
    return _stabilized(_record(state, now, raw, targets), targets, now, raw, reason, message)


def _while_pods_missing(
    window: MetricsWindow, targets: ScalingTargets, state: ScalingState, now: float, ready: int, seen: int
) -> Decision:
    """Pods are starting, failing or not reporting: no scale-down, and a scale-up only when the
    pods that report are saturated beyond what the others will absorb (a long cold start must not
    stall a burst; the same saturation must not add pods twice)."""
    current = state.current_replicas
    if seen > 0:
        raw, reason, message = _recommend(window, targets, seen, starting=True)
        if reason == "Saturated":
            state = _remember_saturation(state, window, seen, reason)
            # the scale-down window must see this load once the pods are ready
            state = _record(state, now, max(_clamp(raw, targets), current), targets)
        target = min(_clamp(raw, targets), _most_up(current, targets))
        # pods on their way already answer this saturation: add more only for load beyond
        # them by the tolerance (each tick of a cold start must not add a pod)
        if reason == "Saturated" and target > current * (1 + UTILIZATION_TOLERANCE):
            note = f"{message} ({current - seen} of {current} pods not ready or not reporting)"
            return Decision("ScaleUp", target, reason, note, replace(state, current_replicas=target))
    if ready < current:
        return _hold(state, "PodsNotReady", f"{ready} of {current} pods ready")
    return _hold(state, "MetricsMissing", f"{current - seen} of {current} ready pods not reporting")


def _stabilized(
    state: ScalingState, targets: ScalingTargets, now: float, raw: int, reason: str, message: str
) -> Decision:
    """The raw recommendation through the stabilisation windows and step limits: fast up, slow down."""
    current = state.current_replicas
    history, since = state.recommendations, state.history_since
    assert since is not None
    if raw > current:
        # Fast up: the lowest recommendation of the (short) up window, so one spike is not enough
        # when that window is set; at most max_scale_up_step pods at once.
        up_window = [r for t, r in history if now - t <= targets.scale_up_stabilization_s]
        target = min(min(up_window), _most_up(current, targets))
        if target <= current:
            return _hold(state, "Stabilizing", f"{message}; waiting out the scale-up window")
        new_state = replace(state, current_replicas=target)
        return Decision("ScaleUp", target, reason, message, new_state)

    if raw < current:
        # Slow down: only to the highest recommendation of the whole down window, and only once
        # the history covers that window.
        window = scale_down_window_s(targets, state)
        if now - since < window:
            note = f"{message}; scale-down window ({window:.0f}s) not yet observed"
            return _hold(state, "Stabilizing", note)
        period = SCALE_DOWN_PERIOD_SHARE * window
        if state.scaled_down_at is not None and now - state.scaled_down_at < period:
            return _hold(
                state, "Stabilizing", f"{message}; scaled down {now - state.scaled_down_at:.0f}s ago"
            )
        down_window = [r for t, r in history if now - t <= window]
        target = max(max(down_window), current - max(targets.max_scale_down_step, current // 2))
        if target >= current:
            return _hold(
                state, "Stabilizing", f"{message}; higher load within the scale-down window ({window:.0f}s)"
            )
        new_state = replace(state, current_replicas=target, scaled_down_at=now)
        return Decision("ScaleDown", target, reason, message, new_state)

    return _hold(state, reason, message)
