"""Scaling ahead of bursts: what the policy learns (operator/bursts.py) and what it does with it
(tandem.operator.policy.decide, reason BurstHeadroom)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy_properties import wild_windows

from tandem.operator import bursts as b
from tandem.operator.bursts import Bursts
from tandem.operator.policy import (
    MetricsWindow,
    ScalingState,
    ScalingTargets,
    burst_headroom,
    decide,
    load_in_pods,
    sanitized,
)

TARGETS = ScalingTargets(min_replicas=1, max_replicas=20, scale_down_stabilization_s=300, pod_start_s=120)
CAPACITY = 10_000.0  # tokens/s one pod could generate at the mix
TICK = 15.0
HOUR = 3600.0


def window(load: float, pods: int, now: float) -> MetricsWindow:
    """What `pods` pods report carrying `load` pods' worth of capacity, quietly (no queue)."""
    tokens = load * CAPACITY
    return MetricsWindow(
        observed_at=now,
        pods=pods,
        requests_running=20.0 * load,
        requests_waiting=0.0,
        idle_fraction=0.001,
        kv_cache_usage=0.05,
        ttft_p95_s=0.1,
        tokens_per_s=tokens,
        capacity_tokens_per_s=pods * CAPACITY,
        recent_tokens_per_s=tokens,
        admitted_per_s=tokens / 200,
        waiting_growth_per_s=0.0,
    )


def learn(loads: list[float], start_s: float = 120.0, t0: float = 0.0) -> Bursts:
    """A Bursts fed one load sample per tick."""
    memory = Bursts()
    for i, load in enumerate(loads):
        memory = memory.observed(t0 + i * TICK, load, start_s)
    return memory


def steady_with_bursts(
    hours: int, burst_hours: set[int], base: float = 4.0, factor: float = 2.0
) -> list[float]:
    """`hours` of a steady load, with one burst to `factor` x (ramped in 60 s, held 10 min) in each
    of `burst_hours`."""
    per_hour = int(HOUR / TICK)
    loads = []
    for i in range(hours * per_hour):
        hour, tick = divmod(i, per_hour)
        into = tick * TICK - 1800.0  # the burst begins at half past
        up = min(max(into / 60.0, 0.0), 1.0) if hour in burst_hours and into < 600 else 0.0
        loads.append(base * (1 + (factor - 1) * up))
    return loads


def test_growth_within_one_start_is_learned_from_a_synthetic_day():
    memory = learn(steady_with_bursts(24, {3, 9, 15, 21}))
    growth, hours, of_hours = memory.learned(24 * HOUR)
    assert growth == pytest.approx(2.0)
    assert (hours, of_hours) == (3, 24)  # the 90th percentile of 24 hourly highs: the third highest


def test_a_burst_must_recur_to_count_once_a_day_is_learned():
    # two bursty hours of 24: the third highest hour is calm
    memory = learn(steady_with_bursts(24, {3, 15}))
    assert memory.factor(24 * HOUR) == pytest.approx(1.0)
    # within the first hours any burst counts (the highest of fewer than ten hours)
    assert learn(steady_with_bursts(5, {3})).factor(5 * HOUR) == pytest.approx(2.0)


def test_one_scrape_is_noise_not_a_burst():
    loads = [4.0] * 40
    loads[30] = 12.0  # one sample 3x, the next back to normal
    assert learn(loads).factor(40 * TICK) == pytest.approx(1.0)
    loads[31] = 12.0  # two in a row: a burst
    assert learn(loads).factor(40 * TICK) == pytest.approx(3.0)


def test_growth_from_below_half_a_pod_counts_from_half_a_pod():
    loads = [0.01] * 20 + [1.0] * 20  # a quiet ModelServer wakes up
    assert learn(loads).factor(40 * TICK) == pytest.approx(1.0 / b.MIN_LOAD_PODS)


def test_growth_is_measured_over_the_start_it_was_given():
    # the load doubles within 60 s, one pod a scrape: over a 30 s start it grows from 4 to 6 pods
    loads = [4.0] * 20 + [4.0 + 4.0 * min(i * TICK / 60.0, 1.0) for i in range(1, 20)]
    assert learn(loads, start_s=120.0).factor(40 * TICK) == pytest.approx(2.0)
    assert learn(loads, start_s=30.0).factor(40 * TICK) == pytest.approx(6.0 / 4.0)
    # a start as short as the scrape interval still sees the ramp: 4 to 5 pods within it
    assert learn(loads, start_s=TICK).factor(40 * TICK) == pytest.approx(5.0 / 4.0)


def test_the_growth_counts_from_the_load_before_a_burst_not_its_peak():
    at_peak = int((1.5 * HOUR + 300) / TICK)  # five minutes into the second hour's burst
    peak = learn(steady_with_bursts(2, {1})[: at_peak + 1])
    assert peak.loads[-1][1] == 8.0
    assert peak.reference() == pytest.approx(4.0)  # the hour's median, not the peak of 8
    lull = peak.observed((at_peak + 1) * TICK, 3.0, 120.0)
    assert lull.reference() == pytest.approx(3.0)  # below the median: the load now


def test_a_day_later_a_burst_is_forgotten():
    memory = learn(steady_with_bursts(24, {3, 9, 15, 21}))
    for i in range(int(25 * HOUR / TICK)):
        memory = memory.observed(24 * HOUR + i * TICK, 4.0, 120.0)
    assert memory.factor(49 * HOUR) == pytest.approx(1.0)


def test_memory_stays_bounded_at_any_tick_rate():
    """26 hours of samples every second with a burst every hour, a scale-up every minute whose
    pods are ready every tenth time."""
    memory = Bursts()
    peak = [0, 0, 0, 0]
    for i in range(26 * 3600):
        now = float(i)
        memory = memory.observed(now, 3.0 * (2.0 if i % 3600 < 300 else 1.0), 120.0)
        if i % 60 == 0:
            memory = memory.scaled(now, 3, 4 + i % 7)
        if i % 600 == 599:
            memory = memory.ready(now, 6)
        sizes = (len(memory.loads), len(memory.growth), len(memory.starts), len(memory.pending))
        peak = [max(p, n) for p, n in zip(peak, sizes, strict=True)]
    assert peak == [b.MAX_LOAD_SAMPLES, b.GROWTH_BLOCKS, b.START_SAMPLES, b.MAX_PENDING]
    assert memory.factor(26 * 3600.0) == pytest.approx(2.0)


def test_the_start_is_measured_from_a_scale_up_to_its_pods_ready():
    state = ScalingState(2, 2, (), 0.0)
    assert state.bursts.start_s(TARGETS.pod_start_s) == 120.0  # the spec's until measured
    busy = window(2.0, 2, 0.0)  # 2 pods fully busy: saturated
    d = decide(busy, TARGETS, state, 0.0)
    assert d.action == "ScaleUp" and d.replicas >= 3
    state = d.state
    for t in (15.0, 30.0, 45.0):  # the new pods start
        state = decide(window(2.0, 2, t), TARGETS, replace(state, ready_replicas=2), t).state
    state = decide(
        window(2.0, d.replicas, 60.0), TARGETS, replace(state, ready_replicas=d.replicas), 60.0
    ).state
    assert state.bursts.starts == (60.0,) and state.bursts.pending == ()
    assert state.bursts.start_s(TARGETS.pod_start_s) == 60.0


def test_a_scale_down_forgets_the_scale_ups_it_undid_and_lost_pods_expire():
    memory = Bursts().scaled(0.0, 2, 6).scaled(10.0, 6, 8)
    assert memory.scaled(20.0, 8, 6).pending == ((0.0, 6),)
    assert memory.ready(b.MAX_START_S + 11.0, 2).pending == ()  # never ready: nothing measured
    assert memory.ready(b.MAX_START_S + 11.0, 2).starts == ()


def bursty_state(pods: int, base: float) -> tuple[ScalingState, float]:
    """A day of decisions on `pods` pods at `base` pods' worth of load, with a 2x burst in four
    hours: the state after it, and the time."""
    state = ScalingState(pods, pods, (), 0.0)
    loads = steady_with_bursts(24, {3, 9, 15, 21}, base=base)
    now = 0.0
    for i, load in enumerate(loads):
        now = i * TICK
        # the pods are held at `pods` (the test looks at the learning, not at these decisions)
        state = replace(decide(window(load, pods, now), TARGETS, state, now).state, current_replicas=pods)
    return state, now


def test_after_bursts_the_policy_scales_up_ahead_and_says_why():
    # 4 pods' worth of load on 6 pods: 67% of capacity, within the target's tolerance
    state, now = bursty_state(6, 4.0)
    state = replace(state, recommendations=(), scaled_down_at=None)
    now += TICK
    d = decide(window(4.0, 6, now), TARGETS, state, now)
    # 2x the load at 84% of capacity (target 0.7 and its 20% tolerance): ceil(8 / 0.84) = 10 pods
    assert (d.action, d.replicas, d.reason) == ("ScaleUp", 10, "BurstHeadroom")
    assert d.message.startswith("load grew 2.0x within 120 s in 3 of the last 24 hours; ")
    assert "10 pods carry 2.0x the load at 84% of their capacity" in d.message
    room = burst_headroom(d.state, TARGETS, now)
    assert room is not None and (room.growth, room.pods) == (pytest.approx(2.0), 10)


def test_the_headroom_holds_a_scale_down_and_lets_it_go_when_calm():
    state, now = bursty_state(10, 4.0)
    # on 10 pods, 4 pods' worth is spare capacity: without the headroom it would scale down
    off = replace(TARGETS, burst_headroom=False)
    later = now + 1000.0
    plain = decide(window(4.0, 10, later), off, state, later)
    assert (plain.action, plain.reason) == ("ScaleDown", "SpareCapacity")
    held = decide(window(4.0, 10, later), TARGETS, state, later)
    assert (held.action, held.reason) == ("Hold", "BurstHeadroom")
    assert "but load grew 2.0x" in held.message
    # a calm day later the bursts are forgotten: it scales down
    for i in range(int(24 * HOUR / TICK)):
        t = later + i * TICK
        state = replace(decide(window(4.0, 10, t), TARGETS, state, t).state, current_replicas=10)
    t = later + 24 * HOUR + TICK
    state = replace(state, recommendations=(), scaled_down_at=None)
    calm = decide(window(4.0, 10, t), TARGETS, state, t)
    assert (calm.action, calm.reason) == ("ScaleDown", "SpareCapacity")
    assert burst_headroom(calm.state, TARGETS, t).growth == pytest.approx(1.0)


def test_the_headroom_only_acts_a_tolerance_beyond_the_pods():
    # 9 pods are within 20% of the headroom of 10: no scale-up for one pod, and no scale-down
    state, now = bursty_state(9, 4.0)
    now += TICK
    d = decide(window(4.0, 9, now), TARGETS, replace(state, recommendations=()), now)
    assert (d.action, d.replicas, d.reason) == ("Hold", 9, "BurstHeadroom")


def test_a_saturation_scales_up_to_the_headroom_at_least():
    state, now = bursty_state(4, 3.0)
    now += TICK
    busy = replace(window(3.6, 4, now), requests_waiting=40.0)  # a queue on 4 pods at 90%
    d = decide(busy, TARGETS, replace(state, recommendations=()), now)
    assert (d.action, d.reason) == ("ScaleUp", "Saturated")
    assert d.replicas == 8  # ceil(2.0 x 3.0 / 0.84); saturation alone would ask for 6
    assert "load grew 2.0x" in d.message


def test_with_the_headroom_off_nothing_changes_but_it_still_learns():
    state, now = bursty_state(6, 4.0)
    off = replace(TARGETS, burst_headroom=False)
    d = decide(window(4.0, 6, now + TICK), off, state, now + TICK)
    assert d.reason != "BurstHeadroom" and d.action == "Hold"
    assert d.state.bursts.factor(now) == pytest.approx(2.0)


def test_load_samples_wait_for_every_pod_to_report_with_a_rate():
    state = ScalingState(3, 3, (), 0.0)
    w = window(2.0, 3, 0.0)
    assert decide(w, TARGETS, state, 0.0).state.bursts.loads == ((0.0, 2.0),)
    for partial in (replace(w, pods=2), replace(w, counted_pods=2)):
        assert decide(partial, TARGETS, state, 0.0).state.bursts.loads == ()


def test_the_load_counts_what_arrives_not_only_what_is_served():
    w = window(2.0, 2, 0.0)
    assert load_in_pods(w) == pytest.approx(2.0)
    growing = replace(w, waiting_growth_per_s=w.admitted_per_s)  # the queue grows as fast as served
    assert load_in_pods(growing) == pytest.approx(4.0)
    draining = replace(w, waiting_growth_per_s=-0.5 * w.admitted_per_s)  # the backlog is half of it
    assert load_in_pods(draining) == pytest.approx(1.0)
    assert load_in_pods(replace(w, capacity_tokens_per_s=None)) is None



@given(wild_windows)
@settings(max_examples=300, deadline=None)
def test_the_load_of_any_window_is_a_finite_number_or_none(w: MetricsWindow):
    load = load_in_pods(sanitized(w))
    assert load is None or 0.0 <= load <= 1e12


def test_the_simulator_feeds_the_policy_what_it_learns_from():
    """The simulated pods start in 45 s: Tandem's scaler measures that from its scale-ups (the
    spec says 120 s), learns the bursts' growth within it, and keeps pods for it."""
    from tandem.bench.autoscale.fair import BY_NAME
    from tandem.bench.autoscale.sim import Setup, simulate
    from tandem.bench.autoscale.trace import make_trace, shape

    trace = make_trace(replace(shape("chat", 4.0, 7), trough_rps=80.0, bursts_per_day=36.0))
    runs = {}
    for on in (True, False):
        setup = Setup(cold_start_s=45.0, tandem_burst_headroom=on)
        scaler = BY_NAME["tandem_default"].make(None, setup)
        runs[on] = simulate(trace, scaler, setup).summary
        memory = scaler.state.bursts
        assert memory.start_s(120.0) == 45.0 and memory.starts
        assert memory.factor(4 * HOUR) > 1.3
        # the summary says what was learned: the memory's own hourly highs
        assert runs[on]["learned_hourly_growth"] == [round(r, 3) for _, r in memory.growth]
    assert runs[True]["decision_reasons"].get("BurstHeadroom", 0) > 0
    assert max(runs[True]["learned_hourly_growth"]) > 1.3
    assert "BurstHeadroom" not in runs[False]["decision_reasons"]
    assert runs[True]["gpu_hours"] >= runs[False]["gpu_hours"]


# what a restarted operator takes back from status.learnedBursts
NOW = 1_800_000_000.0  # an epoch time: RFC 3339 in the status
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=30) | st.dictionaries(st.text(max_size=15), inner, max_size=5),
    max_leaves=60,
)


def test_what_the_status_keeps_restores_the_growth_and_starts_but_not_the_loads():
    memory = learn(steady_with_bursts(24, {3, 9, 15, 21}), t0=NOW - 24 * HOUR)
    memory = memory.scaled(NOW - 300.0, 2, 4).ready(NOW - 250.0, 4)
    kept = json.loads(json.dumps(memory.as_status()))  # as the API server stores it
    back = Bursts.from_status(kept, NOW)
    assert back.factor(NOW) == pytest.approx(memory.factor(NOW), abs=1e-4) and back.factor(NOW) > 1.5
    assert back.learned(NOW)[1:] == memory.learned(NOW)[1:]
    assert back.starts == (50.0,) and back.start_s(120.0) == 50.0
    assert back.loads == () and back.pending == ()
    # learning goes on from there: the next hour's growth is one more hour
    later = back.observed(NOW + 15.0, 4.0, 50.0).observed(NOW + 30.0, 4.0, 50.0)
    assert later.learned(NOW + 30.0)[2] == memory.learned(NOW)[2]


def test_a_status_edited_by_hand_gives_back_only_what_is_sound():
    hour = {"since": "2027-01-15T07:00:00Z", "ratio": 2.5}  # within the day before NOW (08:00)
    status = {
        "hourlyGrowth": [
            hour,
            {"since": "2027-01-15T06:00:00Z", "ratio": float("nan")},
            {"since": "2027-01-15T05:00:00Z", "ratio": 0.5},  # a growth is at least 1
            {"since": "2027-01-15T04:00:00", "ratio": 2.0},  # no time zone
            {"since": "yesterday", "ratio": 2.0},
            {"since": "2027-01-14T07:00:00Z", "ratio": 9.0},  # older than a day
            {"since": "2027-01-15T09:00:00Z", "ratio": 9.0},  # in the future
            {"since": "2027-01-15T03:00:00Z", "ratio": True},
            "2.0",
        ],
        "podStartSeconds": [45.0, -1.0, "30", None, 1e9, 60],
    }
    back = Bursts.from_status(status, NOW)
    assert [r for _, r in back.growth] == [2.5] and back.starts == (45.0, 60.0)
    for nothing in (None, [], "x", {"hourlyGrowth": {"since": 1}}, {"podStartSeconds": 3}):
        assert Bursts.from_status(nothing, NOW) == Bursts()


@settings(max_examples=300, deadline=None)
@given(JSON, st.lists(st.tuples(st.floats(NOW - 30 * HOUR, NOW + HOUR), st.floats(-10, 1e6)), max_size=40))
def test_whatever_the_status_holds_the_restored_memory_is_bounded_and_usable(junk, entries):
    for status in (junk, {"hourlyGrowth": [{"since": b.now_iso(t), "ratio": r} for t, r in entries],
                          "podStartSeconds": [r for _, r in entries]}):
        back = Bursts.from_status(status, NOW)
        assert len(back.growth) <= b.GROWTH_BLOCKS and len(back.starts) <= b.START_SAMPLES
        assert all(NOW - b.GROWTH_BLOCKS * HOUR < t <= NOW and r >= 1.0 for t, r in back.growth)
        assert 1.0 <= back.factor(NOW) < math.inf and 0.0 < back.start_s(120.0) <= b.MAX_START_S
        once = Bursts.from_status(json.loads(json.dumps(back.as_status())), NOW)
        assert Bursts.from_status(json.loads(json.dumps(once.as_status())), NOW) == once
