"""The scaling policy's decisions, case by case (tandem.operator.policy.decide)."""

from __future__ import annotations

from dataclasses import replace

from tandem.operator.bursts import Bursts
from tandem.operator.policy import (
    SCALE_DOWN_WINDOW_BOUNDS_S,
    SCALE_DOWN_WINDOW_STARTS,
    Decision,
    MetricsWindow,
    ScalingState,
    ScalingTargets,
    decide,
    scale_down_window_s,
)

TARGETS = ScalingTargets(
    min_replicas=1,
    max_replicas=10,
    target_ttft_s=1.0,
    cost_ceiling_usd_per_mtok=0.5,
    target_batch_fill=0.8,
    scale_down_idle_fraction=0.5,
    scale_up_stabilization_s=0,
    scale_down_stabilization_s=300,
    max_scale_up_step=4,
    max_scale_down_step=2,
    max_num_seqs=100,
)


def window(pods: int = 2, now: float = 1000.0, **kw: float | None) -> MetricsWindow:
    base: dict = dict(
        observed_at=now,
        pods=pods,
        requests_running=50.0 * pods,
        requests_waiting=0.0,
        idle_fraction=0.0,
        kv_cache_usage=0.3,
        ttft_p95_s=0.2,
        tokens_per_s=2000.0 * pods,
        cost_per_mtok_usd=0.3,
    )
    base.update(kw)
    return MetricsWindow(**base)


def state(current: int = 2, ready: int | None = None, since: float | None = 0.0) -> ScalingState:
    return ScalingState(current, current if ready is None else ready, (), since)


def run(w: MetricsWindow | None, s: ScalingState, now: float = 1000.0, targets=TARGETS) -> Decision:
    return decide(w, targets, s, now)


def test_within_targets_holds():
    d = run(window(), state())
    assert (d.action, d.replicas, d.reason) == ("Hold", 2, "WithinTargets")


def test_queue_scales_up_in_proportion_to_demand():
    # 2 pods full at 100 running each with 200 more waiting: twice the demand they carry.
    d = run(window(requests_running=200.0, requests_waiting=200.0, kv_cache_usage=0.9), state())
    assert (d.action, d.reason) == ("ScaleUp", "Saturated")
    assert d.replicas == 4
    assert "queue" in d.message


def test_batch_fill_over_target_scales_up():
    d = run(window(requests_running=180.0), state())  # 90% of max_num_seqs
    assert d.action == "ScaleUp" and d.replicas == 3


def test_kv_cache_usage_counts_as_fill():
    d = run(window(kv_cache_usage=0.95), state())
    assert d.action == "ScaleUp" and "batch fill" in d.message


def test_ttft_over_target_adds_at_least_one_pod():
    d = run(window(ttft_p95_s=2.5), state())
    assert d.action == "ScaleUp" and d.replicas == 3 and "TTFT" in d.message


def test_scale_up_is_step_limited_and_bounded():
    d = run(window(requests_running=200.0, requests_waiting=5000.0), state())
    assert d.replicas == 2 + TARGETS.max_scale_up_step
    d = run(window(pods=9, requests_running=900.0, requests_waiting=5000.0), state(9))
    assert d.replicas == TARGETS.max_replicas


def test_idle_pods_scale_down_after_the_window_to_what_carries_the_load():
    quiet = window(pods=6, requests_running=30.0, idle_fraction=0.7, kv_cache_usage=0.05)
    s = state(6, since=0.0)
    d = run(quiet, s, now=1000.0)
    # fill 5% of 6 pods: one pod carries it, but one decision at most halves the pods (or
    # removes maxScaleDownStep, if that is more).
    assert (d.action, d.replicas, d.reason) == ("ScaleDown", 3, "Underused")


def test_cost_above_ceiling_scales_down():
    w = window(pods=4, requests_running=40.0, kv_cache_usage=0.1, cost_per_mtok_usd=1.2)
    d = run(w, state(4))
    assert (d.action, d.reason) == ("ScaleDown", "CostAboveCeiling") and d.replicas == 2


def test_cost_above_ceiling_holds_when_remaining_pods_could_not_carry_it():
    # 2 pods at 55% fill: one pod would be at 110%, so stay even though tokens cost too much.
    w = window(requests_running=110.0, cost_per_mtok_usd=0.9)
    d = run(w, state())
    assert (d.action, d.replicas, d.reason) == ("Hold", 2, "CostCeilingUnreachable")
    assert "could not carry" in d.message


def test_an_unreachable_cost_ceiling_does_not_fight_the_slo():
    """Long prompts, short answers: the ceiling asks for fewer pods than the TTFT target needs.
    The first cost scale-down breaks TTFT and scales back up; from then on the policy remembers
    what a pod carried when saturated and holds (CostCeilingUnreachable) instead of cycling."""
    targets = replace(TARGETS, scale_down_stabilization_s=0)
    # 4 pods, low fill (few running: short answers), tokens too expensive
    cheap_fill = dict(requests_running=40.0, kv_cache_usage=0.1, tokens_per_s=400.0, cost_per_mtok_usd=2.0)
    d = run(window(pods=4, **cheap_fill), state(4), targets=targets)
    assert (d.action, d.reason, d.replicas) == ("ScaleDown", "CostAboveCeiling", 2)
    # at 2 pods the same load breaks TTFT (prefill-bound): scale up again
    d = run(
        window(pods=2, **{**cheap_fill, "ttft_p95_s": 3.0}),
        replace(d.state, ready_replicas=2),
        1015.0,
        targets,
    )
    assert (d.action, d.reason) == ("ScaleUp", "Saturated") and d.replicas >= 3
    assert d.state.saturated_tokens_per_pod == 200.0
    # at 4 pods again, TTFT fine, cost still above the ceiling: down to 3 pods at most, where the
    # remembered rate (200 tokens/s per pod at saturation) leaves room, not to 2 again
    s = replace(d.state, current_replicas=4, ready_replicas=4)
    d = run(window(pods=4, **cheap_fill), s, 1030.0, targets)
    assert (d.action, d.replicas, d.reason) == ("ScaleDown", 3, "CostAboveCeiling")
    # at 3 pods: hold, and say why
    d = run(window(pods=3, **cheap_fill), replace(d.state, ready_replicas=3), 1031.0, targets)
    assert (d.action, d.replicas, d.reason) == ("Hold", 3, "CostCeilingUnreachable")
    assert "the TTFT target needs 3 pods at this load" in d.message
    # a quarter of the load: that rate says fewer pods do; the cost rule may scale down again
    quarter = {**cheap_fill, "requests_running": 10.0, "tokens_per_s": 100.0}
    d = run(window(pods=3, **quarter), d.state, 1045.0, targets)
    assert (d.action, d.reason) == ("ScaleDown", "CostAboveCeiling")
    # pods that carry more than the remembered rate without saturating: the memory goes
    d = run(
        window(pods=3, **{**cheap_fill, "tokens_per_s": 900.0}),
        replace(d.state, current_replicas=3),
        1060.0,
        targets,
    )
    assert d.state.saturated_tokens_per_pod is None


def test_no_cost_trigger_without_ceiling():
    w = window(pods=4, requests_running=40.0, kv_cache_usage=0.1, cost_per_mtok_usd=9.0)
    d = run(w, state(4), targets=replace(TARGETS, cost_ceiling_usd_per_mtok=None))
    assert (d.action, d.reason) == ("Hold", "WithinTargets")


def test_no_scale_down_while_ttft_is_near_target():
    w = window(pods=4, requests_running=20.0, idle_fraction=0.8, ttft_p95_s=0.9)
    d = run(w, state(4))
    assert d.action == "Hold" and "TTFT" in d.message


def test_scale_down_waits_until_history_covers_the_window():
    quiet = window(pods=4, requests_running=4.0, idle_fraction=0.9, kv_cache_usage=0.01)
    s = state(4, since=None)  # a fresh operator: no history yet
    d = run(quiet, s, now=1000.0)
    assert (d.action, d.reason) == ("Hold", "Stabilizing")
    d = run(replace(quiet, observed_at=1200.0), d.state, now=1200.0)
    assert d.action == "Hold"
    d = run(replace(quiet, observed_at=1301.0), d.state, now=1301.0)
    assert d.action == "ScaleDown" and d.replicas == 2


def test_scale_down_goes_only_to_the_highest_recommendation_of_the_window():
    busy = window(pods=4, requests_running=300.0)  # 75% fill: hold at 4 (recommendation 4)
    quiet = window(pods=4, requests_running=4.0, idle_fraction=0.9, kv_cache_usage=0.01)
    d = run(busy, state(4), now=1000.0)
    assert d.action == "Hold"
    d = run(replace(quiet, observed_at=1100.0), d.state, now=1100.0)
    assert (d.action, d.reason) == ("Hold", "Stabilizing")  # the busy minute is inside the window
    d = run(replace(quiet, observed_at=1301.0), d.state, now=1301.0)
    assert d.action == "ScaleDown"


def test_scale_up_stabilization_needs_sustained_saturation():
    targets = replace(TARGETS, scale_up_stabilization_s=60)
    calm, hot = window(), window(requests_running=190.0)
    d = run(calm, state(), now=1000.0, targets=targets)
    d = run(replace(hot, observed_at=1030.0), d.state, now=1030.0, targets=targets)
    assert (d.action, d.reason) == ("Hold", "Stabilizing")
    d = run(replace(hot, observed_at=1061.0), d.state, now=1061.0, targets=targets)
    assert d.action == "ScaleUp"


def test_missing_metrics_hold():
    assert run(None, state()).reason == "MetricsMissing"
    assert run(window(pods=0), state()).reason == "MetricsMissing"
    assert run(window(requests_running=None), state()).reason == "MetricsMissing"


def test_stale_metrics_hold():
    d = decide(window(now=100.0, requests_waiting=999.0), TARGETS, state(), now=1000.0, stale_after_s=60)
    assert (d.action, d.reason) == ("Hold", "MetricsStale")
    # what the window gives when no pod has answered since t=100 (its rounds since are empty)
    empty = MetricsWindow(observed_at=100.0, pods=0, requests_running=None, requests_waiting=None)
    d = decide(empty, TARGETS, state(), now=1000.0, stale_after_s=60)
    assert (d.action, d.reason) == ("Hold", "MetricsStale")
    assert decide(empty, TARGETS, state(), now=130.0, stale_after_s=60).reason == "MetricsMissing"


def test_non_finite_and_huge_metrics_still_decide():
    """The pods' numbers reach the policy as floats: +Inf, NaN and 1e308 give a decision."""
    inf, nan = float("inf"), float("nan")
    d = run(window(requests_running=inf, requests_waiting=inf, kv_cache_usage=inf), state())
    assert (d.action, d.reason, d.replicas) == ("ScaleUp", "Saturated", 6)  # at most max_scale_up_step
    d = run(window(requests_running=1e308, requests_waiting=1e308, ttft_p95_s=1e308), state())
    assert (d.action, d.replicas) == ("ScaleUp", 6)
    d = run(window(requests_running=nan), state())
    assert (d.action, d.reason) == ("Hold", "MetricsMissing")  # NaN is no number: missing
    d = run(window(idle_fraction=nan, cost_per_mtok_usd=inf, ttft_p95_s=nan), state())
    assert d.action in ("Hold", "ScaleDown") and 1 <= d.replicas <= 2
    assert run(window(now=nan), state()).reason == "MetricsStale"


def test_pods_not_ready_hold_while_starting_pods_will_absorb_the_load():
    # 2 ready pods at 90% fill, a third starting: the third covers it, hold.
    d = run(window(requests_running=180.0), state(3, ready=2))
    assert (d.action, d.reason) == ("Hold", "PodsNotReady")
    # all three ready, one not reporting: that is missing metrics, not a pod that is not ready
    d = run(window(pods=2, requests_running=180.0), state(3))
    assert (d.action, d.reason) == ("Hold", "MetricsMissing")
    assert d.message == "1 of 3 ready pods not reporting"
    # no scale-down while pods start, however idle the ready ones are
    d = run(window(requests_running=0.0, idle_fraction=1.0, kv_cache_usage=0.0), state(3, ready=2))
    assert (d.action, d.reason) == ("Hold", "PodsNotReady")


def test_saturation_beyond_the_starting_pods_scales_up_during_a_cold_start():
    # 2 ready pods with 3x their capacity queued; 1 more starting is not enough.
    d = run(window(requests_running=200.0, requests_waiting=400.0), state(3, ready=2))
    assert (d.action, d.reason, d.replicas) == ("ScaleUp", "Saturated", 6)
    assert "1 of 3 pods not ready or not reporting" in d.message
    # the same when the third pod is ready but its /metrics cannot be read
    d = run(window(pods=2, requests_running=200.0, requests_waiting=400.0), state(3))
    assert (d.action, d.reason, d.replicas) == ("ScaleUp", "Saturated", 6)


def test_bounds_apply_before_anything_else():
    d = run(None, state(12))
    assert (d.action, d.replicas, d.reason) == ("ScaleDown", 10, "AboveMaximum")
    d = run(None, state(1), targets=replace(TARGETS, min_replicas=3))
    assert (d.action, d.replicas, d.reason) == ("ScaleUp", 3, "BelowMinimum")


def test_decision_state_carries_the_new_replica_count():
    d = run(window(requests_running=200.0, requests_waiting=200.0), state())
    assert d.state.current_replicas == d.replicas == 4
    assert d.state.recommendations[-1] == (1000.0, 4)


# --- the capacity signal ----------------------------------------------------------------------


def capacity_window(pods: int, utilization: float, now: float = 1000.0, **kw: float | None) -> MetricsWindow:
    """Pods that say each could generate 10,000 tokens/s at their mix, using `utilization` of it."""
    base: dict = dict(
        requests_running=20.0 * pods,
        kv_cache_usage=0.1,
        tokens_per_s=10_000.0 * pods * utilization,
        capacity_tokens_per_s=10_000.0 * pods,
        admitted_per_s=10.0 * pods,
        waiting_growth_per_s=0.0,
    )
    base.update(kw)
    return window(pods, now, **base)


# step limits wide enough not to be what a test sees
WIDE = replace(TARGETS, max_replicas=20, max_scale_up_step=20)


def test_spare_capacity_scales_down_to_the_pods_that_carry_the_load_at_the_target():
    # 8 pods at 20% of what they can do: 8 x 0.2 / 0.7 = 2.3 -> 3 pods, but at most half go at once
    d = run(capacity_window(8, 0.2), state(8))
    assert (d.action, d.replicas, d.reason) == ("ScaleDown", 4, "SpareCapacity")
    d = run(capacity_window(4, 0.2 * 2, now=1300.0), d.state, now=1300.0)  # the window later
    assert (d.action, d.replicas) == ("ScaleDown", 3)


def test_low_fill_alone_scales_down_when_the_pods_report_a_capacity():
    """The defect the fair comparison found: 10 pods at 4% fill and 0.1% idle, no cost ceiling,
    held forever. With the capacity signal they scale down."""
    targets = replace(TARGETS, cost_ceiling_usd_per_mtok=None)
    w = capacity_window(10, 0.05, idle_fraction=0.001, kv_cache_usage=0.01, requests_running=40.0)
    d = run(w, state(10), targets=targets)
    assert (d.action, d.reason) == ("ScaleDown", "SpareCapacity") and d.replicas == 5


def test_capacity_use_within_the_tolerance_holds_and_beyond_it_scales_up():
    assert run(capacity_window(4, 0.8), state(4)).action == "Hold"  # 0.8 / 0.7 = 1.14 < 1.2
    assert run(capacity_window(4, 0.65), state(4)).action == "Hold"  # 3 pods would be at 0.87
    d = run(capacity_window(4, 0.95), state(4))
    # ceil(4 x 0.95 / 0.7) = 6
    assert (d.action, d.replicas, d.reason) == ("ScaleUp", 6, "Saturated")
    assert "capacity use" in d.message


def test_a_burst_in_the_newest_interval_scales_up_before_the_window_mean_moves():
    w = capacity_window(4, 0.7, recent_tokens_per_s=4 * 10_000.0 * 0.98)
    d = run(w, state(4))
    assert (d.action, d.replicas) == ("ScaleUp", 6)  # ceil(4 x 0.98 / 0.7)
    # and the newest interval alone never scales down: a lull in it is not spare capacity
    assert run(capacity_window(4, 0.6, recent_tokens_per_s=0.0), state(4)).action == "Hold"


def test_a_queue_scales_up_by_the_load_offered_not_only_the_load_served():
    # served at full capacity (1.0 = 1.43x the target), arrivals 50% above admissions, 60 s of
    # backlog drained on top: 1.43 x (10 + 5 + 600/60) / 10 = 3.57 -> 2 pods become 8
    w = capacity_window(2, 1.0, requests_waiting=600.0, admitted_per_s=10.0, waiting_growth_per_s=5.0)
    d = run(w, state(2), targets=WIDE)
    assert (d.action, d.replicas, d.reason) == ("ScaleUp", 8, "Saturated")
    assert "queue of 600 requests" in d.message


def test_pods_on_their_way_answer_a_saturation_without_another_pod_each_tick():
    """2 pods were asked for 4: while 2 start, the ready ones stay saturated and their backlog
    grows. Their arrivals need ceil(2 x 1.43 x 1.2) = 4 pods, which are coming: hold. Only load
    beyond the pods coming by the tolerance adds more."""
    s = ScalingState(4, 2, (), 0.0)
    w = capacity_window(2, 1.0, requests_waiting=900.0, admitted_per_s=10.0, waiting_growth_per_s=2.0)
    d = run(w, s, targets=WIDE)
    assert (d.action, d.replicas, d.reason) == ("Hold", 4, "PodsNotReady")
    w = capacity_window(2, 1.0, requests_waiting=900.0, admitted_per_s=10.0, waiting_growth_per_s=20.0)
    d = run(w, s, targets=WIDE)
    assert (d.action, d.replicas) == ("ScaleUp", 9)  # ceil(2 x 1.43 x 3)


def test_the_scale_down_window_remembers_a_saturation_seen_while_pods_started():
    """The load seen while pods were starting counts in the scale-down window once they are
    ready: a backlog drained by the new pods does not scale them straight down again."""
    s = ScalingState(2, 2, (), 0.0)
    burst = capacity_window(2, 1.0, requests_waiting=600.0, admitted_per_s=10.0, waiting_growth_per_s=5.0)
    d = run(burst, s, now=1000.0, targets=WIDE)
    assert d.replicas == 8
    starting = replace(d.state, ready_replicas=2)
    d = run(replace(burst, observed_at=1015.0), starting, now=1015.0, targets=WIDE)
    lull = capacity_window(8, 0.3, now=1100.0)
    d = run(lull, replace(d.state, ready_replicas=8), now=1100.0, targets=WIDE)
    assert (d.action, d.replicas) == ("Hold", 8), d  # the burst is within the 300 s window


def test_one_scale_down_per_half_window():
    # 10 pods at 0.2: 3 carry it at the target; a decision halves at most
    d = run(capacity_window(10, 0.2, requests_running=40.0), state(10), now=1000.0)
    assert (d.action, d.replicas) == ("ScaleDown", 5)
    same_load = {"requests_running": 40.0}
    d = run(capacity_window(5, 0.4, now=1015.0, **same_load), d.state, now=1015.0)
    assert (d.action, d.reason) == ("Hold", "Stabilizing") and "scaled down 15s ago" in d.message
    d = run(capacity_window(5, 0.4, now=1150.0, **same_load), d.state, now=1150.0)  # half the window later
    assert (d.action, d.replicas) == ("ScaleDown", 3)


def test_a_cost_ceiling_packs_the_pods_a_little_and_says_when_it_cannot():
    targets = replace(TARGETS, cost_ceiling_usd_per_mtok=0.2)
    # 4 pods at 0.62: at the target 0.7 they stay 4; the ceiling may pack to 0.77 -> ceil(3.2) = 4
    d = run(capacity_window(4, 0.62, cost_per_mtok_usd=0.3), state(4), targets=targets)
    assert (d.action, d.replicas, d.reason) == ("Hold", 4, "CostCeilingUnreachable")
    d = run(capacity_window(4, 0.55, cost_per_mtok_usd=0.3), state(4), targets=targets)
    # at the target 4 pods are needed (4 x 0.55 / 0.7 = 3.1); packed to 0.77, 3 carry it
    assert (d.action, d.replicas, d.reason) == ("ScaleDown", 3, "CostAboveCeiling")


def test_an_unset_scale_down_window_is_sixteen_measured_pod_starts_within_bounds():
    """Unset in the spec, the window follows the pods' measured start (16 of them, 300-600 s): pods
    that start fast may go sooner, never within the HPA's 300 s; before any start is measured, the
    spec's pod start counts."""
    derived = replace(TARGETS, scale_down_stabilization_s=None, pod_start_s=120.0)
    assert SCALE_DOWN_WINDOW_STARTS == 16 and SCALE_DOWN_WINDOW_BOUNDS_S == (300.0, 600.0)
    assert scale_down_window_s(derived, state()) == 600.0  # 16 x 120 s, at the upper bound
    measured = [(24.0, 384.0), (30.0, 480.0), (5.0, 300.0), (15.0, 300.0), (45.0, 600.0)]
    for start, expected in measured:
        s = replace(state(), bursts=Bursts(starts=(start,)))
        assert scale_down_window_s(derived, s) == expected
        assert scale_down_window_s(TARGETS, s) == 300.0  # a window in the spec is the window
    # the decisions follow it: pods that started in 24 s scale down once 384 s of quiet are seen
    quiet = window(pods=4, requests_running=4.0, idle_fraction=0.9, kv_cache_usage=0.01)
    s = replace(state(4, since=None), bursts=Bursts(starts=(24.0,)))
    d = run(quiet, s, now=1000.0, targets=derived)
    assert (d.action, d.reason) == ("Hold", "Stabilizing")
    assert "(384s)" in d.message
    d = run(replace(quiet, observed_at=1380.0), d.state, now=1380.0, targets=derived)
    assert d.action == "Hold"
    d = run(replace(quiet, observed_at=1385.0), d.state, now=1385.0, targets=derived)
    assert d.action == "ScaleDown" and d.replicas == 2
