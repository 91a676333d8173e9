"""The autoscaling simulation (`tandem bench autoscale`, bench/autoscale/) on short traces and
hand-made metric series: the pods conserve work, each baseline follows its published algorithm, the
trace shapes carry the token mix they claim, and the report holds every cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tandem.bench.autoscale import calibration, fair, pods
from tandem.bench.autoscale.hpa import (
    HorizontalPodAutoscaler,
    Keda,
    KedaScaler,
    external_metric_replicas,
    pods_metric_replicas,
)
from tandem.bench.autoscale.pods import Cluster
from tandem.bench.autoscale.report import markdown
from tandem.bench.autoscale.scalers import (
    KnativeLike,
    MetricHPA,
    TandemScaler,
    capacity_utilization_per_pod,
    gpu_util_per_pod,
)
from tandem.bench.autoscale.sim import Setup, simulate
from tandem.bench.autoscale.trace import SHAPES, TraceConfig, make_trace, shape
from tandem.operator.bursts import Bursts
from tandem.operator.policy import ScalingTargets, decide
from tandem.operator.spec import Scaling


def run(
    scaler, rate_rps: float, seconds: int, replicas: int = 2, prompt: float = 600.0, output: float = 200.0
):
    """A steady load of `rate_rps` requests a second of one size; the cluster, replicas per second,
    tokens made and tokens asked for."""
    cluster = Cluster(replicas, cold_start_s=60)
    history: deque = deque(maxlen=900)
    seen, tokens, snaps = [], 0.0, []
    for t in range(seconds):
        cluster.route(t, [[float(t), rate_rps, prompt, output]])
        snap = cluster.step(t)
        history.append(snap)
        snaps.append(snap)
        tokens += snap.tokens
        if scaler is not None and t and t % scaler.interval_s == 0:
            wanted = scaler(float(t), cluster.replicas, history)
            if wanted != cluster.replicas:
                cluster.scale(wanted, float(t))
        seen.append(cluster.replicas)
    return cluster, seen, tokens, rate_rps * seconds * output, snaps


# --- traces ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_shape_is_diurnal_with_bursts_and_reproducible(name: str):
    a, b = make_trace(shape(name, 24, 3)), make_trace(shape(name, 24, 3))
    assert (a.counts == b.counts).all()
    night, afternoon = a.rate[4 * 3600 : 5 * 3600].mean(), a.rate[13 * 3600 : 15 * 3600].mean()
    assert afternoon > 5 * night
    assert a.rate.max() > 1.2 * SHAPES[name].peak_rps  # a burst above the diurnal peak


def test_shapes_have_the_token_mix_they_claim():
    def mix(name: str) -> tuple[float, float]:
        tr = make_trace(shape(name, 0.01, 1))
        return float(np.mean(tr.prompt_tokens)), float(np.mean(tr.output_tokens))

    chat, decode, prefill = mix("chat"), mix("decode_heavy"), mix("prefill_heavy")
    assert 450 < chat[0] < 650 and 180 < chat[1] < 280  # the chat mix of docs/autoscaling.md
    assert decode[1] > 5 * decode[0] and decode[0] < 150  # short prompts, long answers
    assert 1900 < prefill[0] < 2200 and 35 < prefill[1] < 50  # 2,000-token prompts, 40-token answers
    assert SHAPES["chat"] == TraceConfig()  # the chat trace is the documented default


# --- pods -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hpa_running", "keda_queue", "knative_concurrency", "tandem_default"])
def test_scalers_serve_all_work_within_bounds(name: str):
    setup = Setup(min_replicas=1, max_replicas=6)
    target = {"hpa_running": 32.0, "keda_queue": 1.0, "knative_concurrency": 32.0}.get(name)
    scaler = fair.BY_NAME[name].make(target, setup)
    cluster, seen, tokens, asked, _ = run(scaler, rate_rps=20.0, seconds=900)
    assert all(1 <= r <= 6 for r in seen)
    assert tokens + cluster.output_in_flight() == pytest.approx(asked, rel=1e-6)  # made or on its way


def test_a_prefill_bound_pod_reports_its_backlog_as_waiting():
    # 2,000-token prompts at 1.3x the prompt tokens a pod prefills beside its decoding rows
    rate = 1.3 * pods.PREFILL_SHARE * calibration.load().prefill_tokens_per_s / 2000
    _, _, _, _, snaps = run(None, rate_rps=rate, seconds=120, replicas=1, prompt=2000.0, output=40.0)
    last = snaps[-1]
    assert last.waiting > 500  # as the engine's scheduler counts them: not yet prefilled
    assert snaps[60].running == pytest.approx(last.running)  # decoding only what is prefilled
    assert last.running < 0.6 * 256  # below max_num_seqs: the queue is the only sign of overload


def test_merging_identical_pods_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    trace = make_trace(shape("chat", 0.5, 2))
    setup = Setup()

    def summary() -> dict:
        run = simulate(trace, fair.BY_NAME["knative_concurrency"].make(4.0, setup), setup)
        return {k: v for k, v in run.summary.items() if k != "scaler"}

    merged = summary()
    monkeypatch.setattr(pods, "MERGE_EVERY_S", 10**9)
    assert merged["scaling_events"] > 3  # several groups of pods were started apart
    assert summary() == pytest.approx(merged, rel=1e-4)


def test_gpu_utilisation_reads_busy_with_a_light_load_so_its_hpa_goes_to_max():
    # the naive reference: 5 requests/s keep one H200 pod's batch small but its GPU "busy"
    _, seen, _, _, snaps = run(MetricHPA("util", gpu_util_per_pod, 0.7, 1, 8), rate_rps=5.0, seconds=900)
    assert min(s.util for s in snaps[60:]) > 0.99
    assert max(s.running / s.ready for s in snaps[60:]) < 20
    assert seen[-1] == 8


# --- the HPA's algorithm --------------------------------------------------------------------------


def test_hpa_tolerance_and_ceiling():
    assert pods_metric_replicas(4, 1.08 * 50, 4, 0, 50) == 4  # within 10%: no change
    assert pods_metric_replicas(4, 0.92 * 50, 4, 0, 50) == 4
    assert pods_metric_replicas(4, 1.12 * 50, 4, 0, 50) == 5  # ceil(1.12 x 4)
    assert pods_metric_replicas(4, 0.5 * 50, 4, 0, 50) == 2


def test_hpa_counts_starting_pods_as_idle_up_and_at_target_down():
    # 2 of 6 pods start: up, they count as 0 (8 pods' worth over 6 -> 8); down, as at the target
    assert pods_metric_replicas(6, 2.0 * 50, 4, 2, 50) == 8
    assert pods_metric_replicas(6, 1.5 * 50, 4, 2, 50) == 6  # (4 x 1.5) / 6 = 1.0: within tolerance
    assert pods_metric_replicas(6, 0.5 * 50, 4, 2, 50) == 4  # (4 x 0.5 + 2) / 6 -> ceil(4.0)


def test_hpa_scale_down_waits_for_the_stabilization_window():
    hpa = HorizontalPodAutoscaler(1, 10)
    assert hpa.normalize(0.0, 8, 8) == 8
    for t in range(15, 300, 15):
        assert hpa.normalize(float(t), 8, 2) == 8  # the recommendation of 8 is within 300 s
    assert hpa.normalize(300.0, 8, 2) == 2  # now it is not; 100% a period may go at once


def test_hpa_scale_up_is_limited_to_double_or_four_pods_per_period():
    hpa = HorizontalPodAutoscaler(1, 10)
    assert hpa.normalize(0.0, 2, 20) == 6  # max(2 x 2, 2 + 4)
    assert hpa.normalize(5.0, 6, 20) == 6  # same period: it started at 2
    assert hpa.normalize(15.0, 6, 20) == 10  # max(12, 10), then maxReplicas


def test_external_metric_per_pod_average():
    assert external_metric_replicas(5, 10.0, 2.0) == 5  # 10 / (2 x 5) = 1.0
    assert external_metric_replicas(4, 10.0, 2.0) == 5  # ratio 1.25 -> ceil(10 / 2)
    assert external_metric_replicas(4, 0.0, 2.0) == 0  # the HPA's minReplicas bounds it later


def test_keda_activation_and_cooldown_apply_only_from_and_to_zero():
    keda = KedaScaler(
        Keda(min_replica_count=0, activation_threshold=5.0), max_replicas=10, target_per_pod=2.0
    )
    assert keda(0.0, 0, 4.0) == 0  # below the activation threshold: stays at zero
    assert keda(30.0, 0, 6.0) == 1  # active: KEDA scales 0 -> 1
    assert keda(45.0, 1, 6.0) == 3  # then the HPA: ceil(6 / 2)
    assert keda(60.0, 3, 0.0) == 3  # inactive, within cooldown; the HPA's window holds 3
    assert keda(330.0, 3, 0.0) == 0  # cooldownPeriod (300 s) after the last active poll

    floor = KedaScaler(
        Keda(min_replica_count=2, activation_threshold=5.0), max_replicas=10, target_per_pod=2.0
    )
    assert floor(0.0, 2, 0.0) == 2
    assert floor(400.0, 2, 4.0) == 2  # 4 <= activation, but with minReplicaCount >= 1 it is ignored
    assert floor(415.0, 2, 8.0) == 4


# --- the Knative-like decider ---------------------------------------------------------------------


def test_knative_panics_at_twice_the_ready_pods_and_does_not_scale_down_in_panic():
    kpa = KnativeLike(1, 20, target=10.0)
    assert kpa.decide(0.0, 2, stable=20.0, panic=30.0) == 2  # panic count 3 < 2 x 2
    assert kpa.decide(2.0, 2, stable=20.0, panic=50.0) == 5  # 5 >= 4: panic, up to the panic count
    assert kpa.decide(30.0, 5, stable=20.0, panic=10.0) == 5  # still panicking: no scale-down
    assert kpa.decide(63.0, 5, stable=20.0, panic=10.0) == 2  # a stable window below the threshold


def test_knative_scales_down_at_most_by_half_per_tick():
    kpa = KnativeLike(1, 20, target=10.0)
    assert kpa.decide(0.0, 8, stable=10.0, panic=10.0) == 4  # ceil(10 / 10) = 1, floor(8 / 2) = 4


# --- the comparison and its report ----------------------------------------------------------------


def test_tandem_runs_with_the_crd_defaults():
    targets = fair.crd_defaults(Setup())
    defaults = Scaling()
    assert targets.target_batch_fill == defaults.target_batch_fill
    assert targets.cost_ceiling_usd_per_mtok == defaults.cost_ceiling_per_million_tokens_usd
    assert targets.scale_down_idle_fraction == defaults.scale_down_idle_fraction
    assert (targets.min_replicas, targets.max_replicas) == (2, 24)
    # unset in the CRD: the window follows the measured start
    assert targets.scale_down_stabilization_s is None is defaults.scale_down_stabilization_seconds


def test_tandem_begins_the_day_with_what_it_learned_the_day_before():
    """An operator that ran yesterday keeps what it learned in status.learnedBursts: the simulated
    Tandem begins each trace with what it learned over another trace of the same shape, the
    baselines with nothing."""
    setup = Setup(cold_start_s=45.0)
    assert setup.tandem_day_before  # the comparison's default
    cell = fair.Cell("tandem_default", None, "decode_heavy", 9, 2.0, start_s=45.0)
    scaler = fair.BY_NAME["tandem_default"].make(None, setup)
    fair.remember_the_day_before(scaler, cell, setup)
    assert scaler.clock_offset_s == 7200.0  # today's second 0 follows yesterday's last
    assert max(h["ratio"] for h in scaler.learned_status["hourlyGrowth"]) > 1.2
    run(scaler, rate_rps=5.0, seconds=20)  # one decision, at today's second 15
    assert scaler.state.bursts.loads[-1][0] == 7215.0
    assert scaler.state.bursts.growth == Bursts.from_status(scaler.learned_status, 7215.0).growth
    assert scaler.state.bursts.factor(7215.0) > 1.2  # the headroom is known from the day's start
    fresh = fair.BY_NAME["tandem_default"].make(None, setup)
    run(fresh, rate_rps=5.0, seconds=20)
    assert fresh.learned_status is None and fresh.state.bursts.factor(15.0) == 1.0
    # the day before is Tandem's alone: a baseline's cell is the same with it or without
    hpa = fair.Cell("hpa_capacity", 0.7, "decode_heavy", 9, 1.0, start_s=45.0)
    with_it = fair.run_cell(hpa, setup)[1].summary
    assert with_it == fair.run_cell(hpa, replace(setup, tandem_day_before=False))[1].summary


def test_the_scale_down_window_what_ifs_reach_tandem_and_only_in_one_cell_runs():
    from tandem.bench.autoscale import compare
    from tandem.operator import policy

    scaler = fair.BY_NAME["tandem_default"].make(None, Setup(tandem_scale_down_window_s=600.0))
    assert scaler.targets.scale_down_stabilization_s == 600.0
    scaler = fair.BY_NAME["tandem_default"].make(None, Setup(tandem_scale_down_window_starts=8.0))
    assert scaler.targets.scale_down_window_starts == 8.0
    scaler = fair.BY_NAME["tandem_default"].make(None, Setup())  # the policy's own
    assert scaler.targets.scale_down_window_starts == policy.SCALE_DOWN_WINDOW_STARTS == 16.0
    assert scaler.targets.scale_down_stabilization_s is None
    with pytest.raises(SystemExit):
        compare.parse_args(["--scale-down-window-s", "600"])
    assert compare.parse_args(["--one", "tandem_default", "--scale-down-window-starts", "8"]).one


def test_choose_takes_the_cheapest_target_within_the_slo():
    sweep = {
        0.2: {"ttft_p95_slo_attainment": 1.0, "cost_per_million_tokens_usd": 0.5},
        0.4: {"ttft_p95_slo_attainment": 0.995, "cost_per_million_tokens_usd": 0.4},
        0.8: {"ttft_p95_slo_attainment": 0.98, "cost_per_million_tokens_usd": 0.3},
    }
    assert fair.choose(sweep) == 0.4
    assert fair.choose({t: s for t, s in sweep.items() if t == 0.8}) == 0.8  # none within: most within


@pytest.mark.parametrize("tune_shape", ["chat", None])
def test_report_holds_every_cell_and_every_swept_target(tune_shape: str | None):
    shapes, seeds, starts = list(SHAPES), [1, 2], [15.0, 120.0]
    report, _ = fair.compare(
        Setup(), shapes, seeds, 0.05, tune_shape, 1, grid_points=2, jobs=1, series=False, starts=starts
    )
    assert report["start_s"] == starts and list(report["by_start"]) == ["15", "120"]
    names = {c.name for c in fair.CONTENDERS}
    tuned = {c.name for c in fair.CONTENDERS if c.grid}
    assert "hpa_capacity" in tuned  # the HPA on the pods' capacity gauge is swept like the others
    for part in report["by_start"].values():
        for sh in shapes:
            for sd in seeds:
                cells = part["results"][sh][str(sd)]
                assert set(cells) == names
                for s in cells.values():
                    assert s["cost_per_million_tokens_usd"] > 0 and 0 <= s["ttft_p95_slo_attainment"] <= 1
                assert set(part["verdicts"][sh][str(sd)]) >= {"target_met", "best_baseline", "tandem_cost"}
            assert part["targets"]["hpa_capacity"][sh] in report["contenders"]["hpa_capacity"]["grid"]
        assert list(part["sweep"]) == ([tune_shape] if tune_shape else shapes)
        for per in part["sweep"].values():
            assert set(per) == tuned and all(len(per[n]) == 2 for n in tuned)
    report |= {"date": "today", "command": "test"}
    lines = markdown(report).splitlines()
    for c in fair.CONTENDERS:  # a row for every cell, at every start; the naive reference apart
        for sd in seeds:
            rows = [line for line in lines if line.split(" | ")[0::2][:2] == [f"| {c.label}", str(sd)]]
            assert len(rows) == (0 if c.kind == "reference" else len(shapes) * len(starts))
    verdicts = [line for line in lines if line.endswith(("| yes |", "| **no** |"))]
    assert len(verdicts) == len(shapes) * len(seeds) * len(starts)
    assert not any("GPU utilisation" in line for line in verdicts)
    assert sum(line.startswith(("| 15 s |", "| 120 s |")) for line in lines) == 2 * len(shapes)


def _cell(cost: float, slo: float, events: float = 1.0) -> dict:
    return {
        "cost_per_million_tokens_usd": cost,
        "ttft_p95_slo_attainment": slo,
        "scaling_events_per_hour": events,
    }


def test_the_naive_gpu_utilisation_hpa_never_enters_a_verdict():
    cells = {
        "tandem_default": _cell(0.30, 0.995),
        "hpa_gpu_util": _cell(0.20, 1.0, 0.25),  # cheapest and within the SLO: still not a baseline
        "hpa_running": _cell(0.40, 0.995, 9.0),
        "knative_concurrency": _cell(0.25, 0.98),
    }
    v = fair.verdict(cells)
    assert (v["best_baseline"], v["best_calm_baseline"]) == ("hpa_running", None)
    assert v["tandem_cost_vs_best"] == pytest.approx(0.30 / 0.40 - 1)
    alone = fair.verdict({n: cells[n] for n in ("tandem_default", "hpa_gpu_util")})
    assert alone["best_baseline"] is None and alone["tandem_cost_vs_best"] is None
    assert "hpa_gpu_util" not in fair.BASELINES and fair.BY_NAME["hpa_gpu_util"].kind == "reference"


def test_the_capacity_utilisation_hpa_is_a_fair_baseline_in_the_verdict():
    cells = {
        "tandem_default": _cell(0.30, 0.995),
        "hpa_capacity": _cell(0.28, 0.993, 5.0),
        "hpa_running": _cell(0.40, 0.995, 2.0),
    }
    v = fair.verdict(cells)
    assert (v["best_baseline"], v["best_calm_baseline"]) == ("hpa_capacity", "hpa_running")
    assert not v["tandem_cost_at_most_best"] and not v["target_met"]
    assert "hpa_capacity" in fair.BASELINES and fair.BY_NAME["hpa_capacity"].grid == fair.UTILIZATION_GRID


def test_the_capacity_utilisation_hpa_reads_the_pods_gauge():
    # tokens over capacity per pod, as tandem_capacity_utilization; the HPA settles near its target
    scaler = MetricHPA("cap", capacity_utilization_per_pod, 0.5, 1, 16)
    cluster, seen, _, _, snaps = run(scaler, rate_rps=60.0, seconds=1800, replicas=1)
    last = snaps[-1]
    per_pod = last.capacity_tokens / last.capacity
    assert capacity_utilization_per_pod(last, ScalingTargets()) == pytest.approx(per_pod)
    assert seen[-1] > 1 and 0.5 / 1.1 * (seen[-1] - 1) / seen[-1] < per_pod <= 0.5 * 1.1


def test_tandem_bench_autoscale_writes_json_markdown_and_plot(tmp_path: Path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    tandem = Path(sys.executable).with_name("tandem")
    cmd = [str(tandem), "bench", "autoscale", "--hours", "0.05", "--shapes", "chat", "--seeds", "7",
           "--grid-points", "2", "--jobs", "1", "--out", str(out), "--plot", str(png)]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["start_s"] == [15, 45, 120]  # the start times swept by default
    assert set(report["by_start"]["45"]["results"]["chat"]["7"]) == {c.name for c in fair.CONTENDERS}
    assert report["calibration"]["name"] == calibration.DEFAULT.stem  # the report names its pods
    assert report["calibration"]["file"] == calibration.DEFAULT.name  # by name: no path of this machine
    text = out.with_suffix(".md").read_text()
    assert "| chat | 7 |" in text and f"calibration `{calibration.DEFAULT.stem}`" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unreachable_cost_ceiling_costs_one_try_not_a_cycle():
    """Prefill-heavy load (2,000-token prompts, 40-token answers) whose tokens cost more than the
    $0.5/Mtok ceiling at any pod count that meets the TTFT target. The pods' capacity signal says
    that fewer pods could not carry the load, so the policy holds from the start, saying the
    ceiling is unreachable, rather than scaling down and up again every few minutes (without a
    capacity signal the policy tries once, see test_policy.py)."""
    targets = ScalingTargets(
        min_replicas=1, max_replicas=16, cost_ceiling_usd_per_mtok=0.5, target_batch_fill=0.2
    )
    scaler = TandemScaler(targets, 3.5)
    cluster = Cluster(2, cold_start_s=120)
    history: deque = deque(maxlen=900)
    events = []
    for t in range(3600):
        cluster.route(t, [[float(t), 16.0, 2000.0, 40.0]])
        history.append(cluster.step(t))
        if t and t % scaler.interval_s == 0:
            wanted = scaler(float(t), cluster.replicas, history)
            if wanted != cluster.replicas:
                events.append(t)
                cluster.scale(wanted, float(t))
    assert events == [], events
    window = scaler.window(history)
    assert window.capacity_tokens_per_s is not None
    assert window.cost_per_mtok_usd > 0.5  # the ceiling is indeed out of reach
    d = decide(window, targets, scaler.state, 3600.0, stale_after_s=60)
    assert (d.action, d.reason) == ("Hold", "CostCeilingUnreachable")
