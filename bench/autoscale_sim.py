"""Autoscaling simulation: Tandem's policy against an HPA on GPU utilisation and a Knative-like
concurrency target, on one day of diurnal, bursty LLM traffic served by simulated H200 pods.

    python bench/autoscale_sim.py                      # 24 h trace, writes the JSON and the plot
    python bench/autoscale_sim.py --hours 2 --no-plot  # a quick look

Reports per scaler: cost per million generated tokens, the share of minutes whose p95 time to
first token meets the SLO, scaling events per hour, mean and peak pods. See docs/autoscaling.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import _repo  # noqa: F401  (makes tandem.operator importable without installing)
import numpy as np
from autoscale.pods import (
    KV_CAPACITY_TOKENS,
    PREFILL_TOKENS_PER_S,
    STEP_BASE_S,
    STEP_PER_SEQ_S,
    TTFT_BUCKETS,
    Cluster,
)
from autoscale.scalers import KnativeLike, Scaler, TandemScaler, UtilisationHPA
from autoscale.trace import Trace, TraceConfig, make_trace

from tandem.operator.histogram import histogram_quantile
from tandem.operator.policy import ScalingTargets

REPO = Path(__file__).resolve().parent.parent


def simulate(trace: Trace, scaler: Scaler, args: argparse.Namespace) -> dict:
    cluster = Cluster(args.start_replicas, args.cold_start_s)
    history: deque = deque(maxlen=900)
    minutes = trace.seconds // 60 + 1
    ttft_minutes = np.zeros((minutes, len(TTFT_BUCKETS)))
    replicas = np.zeros(trace.seconds, dtype=np.int32)
    pods = np.zeros(trace.seconds, dtype=np.int32)
    gpu_seconds = tokens = 0.0
    events = 0
    quarter = trace.counts / 4
    for t in range(trace.seconds):
        arrivals = []
        if quarter[t] > 0:
            arrivals = [
                [float(t), quarter[t], p, o]
                for p, o in zip(trace.prompt_tokens, trace.output_tokens, strict=True)
            ]
        cluster.route(t, arrivals)
        snap = cluster.step(t)
        history.append(snap)
        ttft_minutes[t // 60] += snap.ttft_buckets
        gpu_seconds += snap.pods * args.gpus_per_pod
        tokens += snap.tokens
        if t > 0 and t % scaler.interval_s == 0:
            wanted = scaler(float(t), cluster.replicas, history)
            if wanted != cluster.replicas:
                events += 1
                cluster.scale(wanted, float(t))
        replicas[t], pods[t] = cluster.replicas, snap.pods

    cumulative = np.cumsum(ttft_minutes, axis=1)
    served = cumulative[:, -1] > 0
    p95 = np.array([histogram_quantile(0.95, TTFT_BUCKETS, c) or 0.0 for c in cumulative[served]])
    slo_bucket = int(np.searchsorted(TTFT_BUCKETS, args.ttft_slo_s))  # the SLO is a bucket bound
    hours = trace.seconds / 3600
    result = {
        "scaler": scaler.name,
        "cost_per_million_tokens_usd": round(gpu_seconds / 3600 * args.price / tokens * 1e6, 4),
        "ttft_p95_slo_attainment": round(float((p95 <= args.ttft_slo_s).mean()), 4),
        "requests_within_ttft_slo": round(
            float(cumulative[:, slo_bucket].sum() / cumulative[:, -1].sum()), 4
        ),
        "scaling_events_per_hour": round(events / hours, 2),
        "scaling_events": events,
        "gpu_hours": round(gpu_seconds / 3600, 2),
        "tokens_generated": round(tokens),
        "mean_pods": round(float(pods.mean()), 2),
        "peak_pods": int(pods.max()),
        "worst_minute_ttft_p95_s": round(float(p95.max()), 3),
    }
    if isinstance(scaler, TandemScaler):
        reasons = scaler.last_reasons
        result["decision_reasons"] = {r: reasons.count(r) for r in sorted(set(reasons))}
    return {"summary": result, "replicas": replicas, "pods": pods, "p95_minutes": (served, p95)}


def plot(trace: Trace, runs: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = np.arange(trace.seconds) / 3600
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True, height_ratios=[3, 2])
    load = top.twinx()
    per_minute = trace.counts[: trace.seconds // 60 * 60].reshape(-1, 60).mean(axis=1)
    load.fill_between(np.arange(len(per_minute)) / 60, per_minute, color="0.85", label="load")
    load.set_ylabel("requests / s (grey)")
    top.set_zorder(load.get_zorder() + 1)
    top.patch.set_visible(False)
    colors = {"tandem": "tab:green", "hpa_gpu_util_70": "tab:red", "knative_concurrency_70": "tab:blue"}
    for name, run in runs.items():
        top.step(hours, run["pods"], where="post", color=colors[name], lw=1.2, label=name)
        served, p95 = run["p95_minutes"]
        minute_hours = np.nonzero(served)[0] / 60
        bottom.plot(minute_hours, np.maximum(p95, 1e-3), color=colors[name], lw=0.8, label=name)
    top.set_ylabel("pods (GPUs)")
    top.legend(loc="upper left")
    top.set_title("Autoscaling simulation: pods and load over one day (H200, Llama-3.1-8B shape)")
    bottom.axhline(args.ttft_slo_s, color="k", ls="--", lw=0.8, label=f"SLO {args.ttft_slo_s:g} s")
    bottom.set_yscale("log")
    bottom.set_ylabel("TTFT p95 per minute, s")
    bottom.set_xlabel("hour of day")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--price", type=float, default=3.5, help="USD per GPU-hour")
    parser.add_argument("--gpus-per-pod", type=int, default=1)
    parser.add_argument("--cold-start-s", type=float, default=120.0)
    parser.add_argument("--ttft-slo-s", type=float, default=1.0)
    parser.add_argument("--cost-ceiling", type=float, default=0.50, help="Tandem: USD per million tokens")
    parser.add_argument("--target-batch-fill", type=float, default=0.2, help="Tandem: saturation fill")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--max-replicas", type=int, default=16)
    parser.add_argument("--start-replicas", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/autoscale_sim.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs/images/autoscale_sim.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--only",
        choices=["tandem", "hpa_gpu_util_70", "knative_concurrency_70"],
        default=None,
        help="run one scaler only (for tuning; writes no files)",
    )
    args = parser.parse_args()

    trace = make_trace(TraceConfig(hours=args.hours, seed=args.seed))
    targets = ScalingTargets(
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ttft_s=args.ttft_slo_s,
        cost_ceiling_usd_per_mtok=args.cost_ceiling,
        target_batch_fill=args.target_batch_fill,
    )
    scalers: list[Scaler] = [
        TandemScaler(targets, args.price * args.gpus_per_pod),
        UtilisationHPA(args.min_replicas, args.max_replicas),
        KnativeLike(args.min_replicas, args.max_replicas),
    ]
    if args.only:
        scalers = [s for s in scalers if s.name == args.only]
    runs = {}
    for scaler in scalers:
        started = time.monotonic()
        runs[scaler.name] = simulate(trace, scaler, args)
        runs[scaler.name]["summary"]["simulated_in_s"] = round(time.monotonic() - started, 1)
        print(json.dumps(runs[scaler.name]["summary"]), file=sys.stderr)

    if args.only:
        return 0
    summaries = {name: run["summary"] for name, run in runs.items()}
    tandem, hpa = summaries["tandem"], summaries["hpa_gpu_util_70"]
    saving = 1 - tandem["cost_per_million_tokens_usd"] / hpa["cost_per_million_tokens_usd"]
    targets_check = {
        "cost_saving_vs_hpa": round(saving, 4),
        "cost_saving_target": 0.20,
        "slo_attainment_at_least_hpa": tandem["ttft_p95_slo_attainment"] >= hpa["ttft_p95_slo_attainment"],
        "events_per_hour_target": 6,
        "events_per_hour_met": tandem["scaling_events_per_hour"] <= 6,
    }
    report = {
        "benchmark": "autoscale_sim",
        "date": datetime.date.today().isoformat(),
        "command": "python bench/autoscale_sim.py " + " ".join(sys.argv[1:]),
        "trace": {
            **{k: v for k, v in asdict(trace.config).items()},
            "requests": int(trace.counts.sum()),
            "peak_rate_rps": round(float(trace.rate.max()), 1),
            "cohort_prompt_tokens": [round(p) for p in trace.prompt_tokens],
            "cohort_output_tokens": [round(o) for o in trace.output_tokens],
        },
        "pod_model": {
            "decode_step_s": f"{STEP_BASE_S} + {STEP_PER_SEQ_S} x sequences (H200, 8B shape, measured)",
            "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
            "kv_capacity_tokens": round(KV_CAPACITY_TOKENS),
            "max_num_seqs": 256,
            "cold_start_s": args.cold_start_s,
            "price_per_gpu_hour_usd": args.price,
            "gpus_per_pod": args.gpus_per_pod,
        },
        "ttft_slo_s": args.ttft_slo_s,
        "tandem_targets": asdict(targets),
        "results": summaries,
        "targets": targets_check,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_plot:
        plot(trace, runs, args, args.plot)
    print(json.dumps(report["results"], indent=2))
    print(json.dumps(targets_check, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
