"""Properties of the scaling policy over generated inputs (hypothesis).

Where a property needs coherent metrics, `pod_metrics` turns a demand (concurrent sequences
wanting service) into what n pods would report, with the step-time curve measured on the H200
(docs/autoscaling.md): more demand means more running, more queue, less idle, cheaper tokens.
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.operator.policy import MetricsWindow, ScalingState, ScalingTargets, decide

NOW = 10_000.0


def pod_metrics(demand: float, pods: int, targets: ScalingTargets, now: float = NOW) -> MetricsWindow:
    capacity = pods * targets.max_num_seqs
    running = min(demand, capacity)
    waiting = max(0.0, demand - capacity)
    per_pod = running / pods
    step_s = 0.00785 + 0.0000494 * per_pod  # decode step time on the H200, 8B shape
    tokens_per_s = pods * per_pod / step_s
    # what each pod measures it could do: a full batch of decodes
    capacity = pods * targets.max_num_seqs / (0.00785 + 0.0000494 * targets.max_num_seqs)
    return MetricsWindow(
        observed_at=now,
        pods=pods,
        requests_running=running,
        requests_waiting=waiting,
        idle_fraction=math.exp(-per_pod),
        kv_cache_usage=0.5 * per_pod / targets.max_num_seqs,
        ttft_p95_s=0.05 + (5.0 if waiting > 0 else 0.0),
        tokens_per_s=tokens_per_s,
        cost_per_mtok_usd=(3.5 * pods / (tokens_per_s * 3600) * 1e6) if tokens_per_s > 0 else None,
        capacity_tokens_per_s=capacity,
        recent_tokens_per_s=tokens_per_s,
        admitted_per_s=tokens_per_s / 200,  # requests of 200 tokens each
        waiting_growth_per_s=0.0,
    )


@st.composite
def targets_st(draw: st.DrawFn) -> ScalingTargets:
    low = draw(st.integers(1, 20))
    return ScalingTargets(
        min_replicas=low,
        max_replicas=draw(st.integers(low, 40)),
        target_ttft_s=draw(st.floats(0.05, 10)),
        cost_ceiling_usd_per_mtok=draw(st.none() | st.floats(0.01, 100)),
        target_batch_fill=draw(st.floats(0.1, 1.0)),
        target_utilization=draw(st.floats(0.1, 1.0)),
        scale_down_idle_fraction=draw(st.floats(0.0, 1.0)),
        scale_up_stabilization_s=draw(st.sampled_from([0.0, 30.0, 120.0])),
        scale_down_stabilization_s=draw(st.sampled_from([0.0, 60.0, 600.0, None])),
        max_scale_up_step=draw(st.integers(1, 10)),
        max_scale_down_step=draw(st.integers(1, 10)),
        max_num_seqs=draw(st.integers(1, 512)),
    )


maybe = st.none() | st.floats(0, 1e6, allow_nan=False)
ratio = st.none() | st.floats(0, 1)

windows = st.none() | st.builds(
    MetricsWindow,
    observed_at=st.floats(NOW - 500, NOW),
    pods=st.integers(0, 50),
    requests_running=maybe,
    requests_waiting=maybe,
    idle_fraction=ratio,
    kv_cache_usage=ratio,
    ttft_p95_s=st.none() | st.floats(0, 100),
    tokens_per_s=maybe,
    cost_per_mtok_usd=maybe,
    capacity_tokens_per_s=maybe,
    recent_tokens_per_s=maybe,
    admitted_per_s=maybe,
    waiting_growth_per_s=st.none() | st.floats(-1e6, 1e6),
)

# Anything a pod's /metrics can make of a number: NaN, +-Inf, 1e308 and sums that overflowed.
any_float = (
    st.none()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 5e-324])
)
wild_windows = st.builds(
    MetricsWindow,
    observed_at=st.floats(NOW - 500, NOW) | st.sampled_from([float("nan"), float("-inf"), float("inf")]),
    pods=st.integers(0, 50),
    requests_running=any_float,
    requests_waiting=any_float,
    idle_fraction=any_float,
    kv_cache_usage=any_float,
    ttft_p95_s=any_float,
    tokens_per_s=any_float,
    cost_per_mtok_usd=any_float,
    capacity_tokens_per_s=any_float,
    recent_tokens_per_s=any_float,
    admitted_per_s=any_float,
    waiting_growth_per_s=any_float,
)


def step_limits_hold(targets: ScalingTargets, current: int, replicas: int) -> bool:
    """One decision doubles the pods at most (or adds max_scale_up_step, if more) and halves them
    at most (or removes max_scale_down_step, if more)."""
    most_up = current + max(targets.max_scale_up_step, current)
    most_down = current - max(targets.max_scale_down_step, current // 2)
    return most_down <= replicas <= most_up


histories = st.lists(st.tuples(st.floats(NOW - 1000, NOW), st.integers(0, 60)), max_size=20).map(
    lambda h: tuple(sorted(h))
)


since_st = st.none() | st.floats(0, NOW)


@given(targets_st(), wild_windows, st.integers(0, 60), st.integers(0, 60), histories, since_st)
@settings(max_examples=400, deadline=None)
def test_the_policy_is_total_on_any_float(targets, window, current, ready, history, since):
    """Any float in, a decision out: no exception, and the bounds and step limits still hold."""
    d = decide(window, targets, ScalingState(current, ready, history, since), NOW, stale_after_s=1000)
    assert targets.min_replicas <= d.replicas <= targets.max_replicas
    if targets.min_replicas <= current <= targets.max_replicas:
        assert step_limits_hold(targets, current, d.replicas), d
    assert d.message and d.reason


def test_a_vanishing_admission_rate_behind_a_queue_scales_up_within_bounds():
    """Found by the property above: an admission rate of the smallest float behind a queue made
    the offered share infinite, and rounding it raised instead of scaling up to the bound."""
    targets = ScalingTargets(min_replicas=1, max_replicas=3, target_ttft_s=1.0, target_batch_fill=1.0,
                             target_utilization=1.0, scale_up_stabilization_s=0.0, max_scale_up_step=2,
                             max_num_seqs=1)
    window = MetricsWindow(observed_at=NOW, pods=1, requests_running=0.0, requests_waiting=1.0,
                           tokens_per_s=1.0, capacity_tokens_per_s=1.0, admitted_per_s=5e-324)
    d = decide(window, targets, ScalingState(1, 1, (), None), NOW, stale_after_s=1000)
    assert (d.action, d.replicas) == ("ScaleUp", 3)


MISSING = ["none", "no pods", "no running", "stale"]


@given(targets_st(), windows, st.integers(0, 60), st.integers(0, 60), histories, since_st)
@settings(max_examples=400, deadline=None)
def test_bounds_and_step_limits_always_hold(targets, window, current, ready, history, since):
    d = decide(window, targets, ScalingState(current, ready, history, since), NOW)
    assert targets.min_replicas <= d.replicas <= targets.max_replicas
    assert d.state.current_replicas == d.replicas
    if targets.min_replicas <= current <= targets.max_replicas:
        assert step_limits_hold(targets, current, d.replicas), d
    direction = {"ScaleUp": 1, "ScaleDown": -1, "Hold": 0}[d.action]
    assert direction == (d.replicas > current) - (d.replicas < current)


@given(targets_st(), st.integers(1, 40), histories, st.sampled_from(MISSING))
@settings(max_examples=200, deadline=None)
def test_missing_or_stale_metrics_hold(targets, current, history, how):
    current = max(targets.min_replicas, min(targets.max_replicas, current))
    w = pod_metrics(10_000.0, current, targets)  # a heavy load, had the metrics been there
    window = {
        "none": None,
        "no pods": MetricsWindow(NOW, 0, None, None),
        "no running": MetricsWindow(NOW, current, None, 5.0, 0.9, 0.99, 9.0),
        "stale": w.__class__(**{**w.__dict__, "observed_at": NOW - 301}),
    }[how]
    d = decide(window, targets, ScalingState(current, current, history, 0.0), NOW, stale_after_s=300)
    assert (d.action, d.replicas) == ("Hold", current)
    assert d.reason in ("MetricsMissing", "MetricsStale")


@given(targets_st(), st.integers(1, 40), st.floats(0, 2.5), st.floats(0, 2.5), histories)
@settings(max_examples=400, deadline=None)
def test_more_load_never_gets_fewer_replicas(targets, current, load_a, load_b, history):
    """Load is in units of what the current pods hold (1.0 = every pod at max_num_seqs)."""
    current = max(targets.min_replicas, min(targets.max_replicas, current))
    low, high = (u * current * targets.max_num_seqs for u in sorted((load_a, load_b)))
    state = ScalingState(current, current, history, 0.0)  # history covers every window
    d_low = decide(pod_metrics(low, current, targets), targets, state, NOW)
    d_high = decide(pod_metrics(high, current, targets), targets, state, NOW)
    assert d_low.replicas <= d_high.replicas


@given(targets_st(), st.integers(1, 40), st.floats(0, 1.2))
@settings(max_examples=400, deadline=None)
def test_a_scale_down_never_leaves_the_pods_saturated(targets, current, load):
    """Hysteresis: the pods left after a scale-down carry the same load, 10% more even,
    without counting as saturated, so the next decision does not scale straight back up."""
    current = max(targets.min_replicas, min(targets.max_replicas, current))
    demand = load * current * targets.max_num_seqs
    state = ScalingState(current, current, (), 0.0)
    d = decide(pod_metrics(demand, current, targets), targets, state, NOW)
    if d.action == "ScaleDown" and d.reason in ("SpareCapacity", "Underused", "CostAboveCeiling"):
        after = decide(pod_metrics(1.1 * demand, d.replicas, targets), targets, d.state, NOW + 15)
        assert after.action != "ScaleUp", (d, after)


@given(
    st.floats(0.0, 3000.0),
    st.floats(0.0, 0.10),
    st.integers(1, 30),
    st.integers(0, 2**32 - 1),
    st.sampled_from([None, 0.2, 0.5, 2.0]),
)
@settings(max_examples=60, deadline=None)
def test_noisy_steady_load_never_flaps(mean_demand, noise, start, seed, ceiling):
    """Two hours of decisions every 15 s on a load that wobbles by up to +-10%: the replica
    count may move towards where it belongs, but never reverses."""
    targets = ScalingTargets(
        min_replicas=1,
        max_replicas=30,
        cost_ceiling_usd_per_mtok=ceiling,
        scale_down_stabilization_s=300,
        max_num_seqs=256,
    )
    rng = random.Random(seed)
    state = ScalingState(start, start, (), None)
    moves = []
    for i in range(480):
        now = 15.0 * i
        demand = mean_demand * (1 + rng.uniform(-noise, noise))
        d = decide(pod_metrics(demand, state.current_replicas, targets, now), targets, state, now)
        if d.action != "Hold":
            moves.append(d.action)
        state = d.state
    assert len(set(moves)) <= 1, moves
