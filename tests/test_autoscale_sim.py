"""The autoscaling simulation (bench/autoscale_sim.py) on short traces: it conserves work, keeps
every scaler within its bounds, and shows the effect it exists to measure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from autoscale.pods import Cluster  # noqa: E402
from autoscale.scalers import KnativeLike, TandemScaler, UtilisationHPA  # noqa: E402
from autoscale.trace import TraceConfig, make_trace  # noqa: E402

from tandem.operator.policy import ScalingTargets, decide  # noqa: E402


def run(scaler, rate_rps: float, seconds: int, replicas: int = 2) -> tuple[Cluster, list[int], float, float]:
    """A steady Poisson load of `rate_rps` 600-token prompts asking 200 tokens each."""
    cluster = Cluster(replicas, cold_start_s=60)
    history: deque = deque(maxlen=900)
    seen, tokens = [], 0.0
    for t in range(seconds):
        cluster.route(t, [[float(t), rate_rps, 600.0, 200.0]])
        snap = cluster.step(t)
        history.append(snap)
        tokens += snap.tokens
        if t and t % scaler.interval_s == 0:
            wanted = scaler(float(t), cluster.replicas, history)
            if wanted != cluster.replicas:
                cluster.scale(wanted, float(t))
        seen.append(cluster.replicas)
    return cluster, seen, tokens, rate_rps * seconds * 200


def test_trace_is_diurnal_with_bursts_and_reproducible():
    a, b = make_trace(TraceConfig(hours=24, seed=3)), make_trace(TraceConfig(hours=24, seed=3))
    assert (a.counts == b.counts).all()
    night, afternoon = a.rate[4 * 3600 : 5 * 3600].mean(), a.rate[13 * 3600 : 15 * 3600].mean()
    assert afternoon > 5 * night
    assert a.rate.max() > 1.2 * TraceConfig().peak_rps  # a burst above the diurnal peak


@pytest.mark.parametrize("name", ["tandem", "hpa", "knative"])
def test_scalers_serve_all_work_within_bounds(name: str):
    scaler = {
        "tandem": TandemScaler(
            ScalingTargets(min_replicas=1, max_replicas=6, cost_ceiling_usd_per_mtok=0.5), 3.5
        ),
        "hpa": UtilisationHPA(1, 6),
        "knative": KnativeLike(1, 6),
    }[name]
    cluster, seen, tokens, asked = run(scaler, rate_rps=20.0, seconds=900)
    assert all(1 <= r <= 6 for r in seen)
    in_flight = sum(
        float((p.count * p.remaining).sum()) + sum(q[1] * q[3] for q in p.queue) for p in cluster.pods
    )
    in_flight += sum(q[1] * q[3] for q in cluster.pending)
    assert tokens + in_flight == pytest.approx(asked, rel=1e-6)  # every asked token is made or on its way


def test_utilisation_hpa_over_scales_a_light_steady_load_and_tandem_does_not():
    # 5 requests/s keep one H200 pod's batch small but its GPU "busy" all the time
    _, hpa, _, _ = run(UtilisationHPA(1, 8), rate_rps=5.0, seconds=900)
    _, tandem, _, _ = run(
        TandemScaler(ScalingTargets(min_replicas=1, max_replicas=8), 3.5), rate_rps=5.0, seconds=900
    )
    assert hpa[-1] == 8
    assert tandem[-1] <= 2


def test_tandem_bench_autoscale_writes_json_and_plot(tmp_path: Path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    tandem = Path(sys.executable).with_name("tandem")
    cmd = [str(tandem), "bench", "autoscale", "--hours", "0.25", "--out", str(out), "--plot", str(png)]
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
    assert set(report["results"]) == {"tandem", "hpa_gpu_util_70", "knative_concurrency_70"}
    for result in report["results"].values():
        assert result["cost_per_million_tokens_usd"] > 0 and 0 <= result["ttft_p95_slo_attainment"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unreachable_cost_ceiling_costs_one_try_not_a_cycle():
    """Prefill-heavy load (2,000-token prompts, 40-token answers) whose tokens cost more than the
    $0.5/Mtok ceiling at any pod count that meets the TTFT target: the cost rule may try fewer
    pods once; TTFT breaks, the pods scale back, and from then on the policy holds, saying the
    ceiling is unreachable (before the fix: a scale-down and a scale-up every few minutes)."""
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
    assert len(events) <= 6, events
    assert not [t for t in events if t > 1800], "no scaling in the second half hour"
    assert scaler.state.saturated_tokens_per_pod is not None
    window = scaler.window(history)
    assert window.cost_per_mtok_usd > 0.5  # the ceiling is indeed out of reach
    d = decide(window, targets, scaler.state, 3600.0, stale_after_s=60)
    assert (d.action, d.reason) == ("Hold", "CostCeilingUnreachable")
