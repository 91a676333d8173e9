"""`tandem bench autoscale`: Tandem's policy against the scalers a platform team would deploy (HPA on
running requests, on batch fill and on Tandem's own capacity utilisation gauge, KEDA on queue
length, a Knative-like concurrency target; the naive HPA on GPU utilisation as a reference apart),
on a day of diurnal, bursty traffic of three shapes (chat, decode-heavy, prefill-heavy) and several
seeds, served by simulated pods calibrated from measured results (bench/autoscale/calibration/),
at several pod start times.

    tandem bench autoscale          # the full comparison: JSON, markdown, plot
    tandem bench autoscale --hours 2 --seeds 7 --grid-points 3 --start-s 45 --no-plot --out /tmp/f.json
    tandem bench autoscale --one hpa_running --target 64 --shape decode_heavy --seed 8
    tandem bench autoscale --calibration bench/autoscale/calibration/2026-12-06_h100_8b.json

Reports every cell (start time, shape, seed, scaler): cost per million generated tokens, the share
of minutes whose p95 time to first token meets the SLO, scaling events per hour, mean and peak pods;
and per trace whether Tandem at the CRD's defaults is within the SLO, calm (<= 3 events/h) and no
dearer than the cheapest fair baseline within the SLO. See docs/autoscaling.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tandem.bench.autoscale import calibration
from tandem.bench.autoscale.fair import BY_NAME, Cell, compare, run_cell
from tandem.bench.autoscale.report import markdown, plot
from tandem.bench.autoscale.sim import Setup
from tandem.bench.autoscale.trace import SHAPES, make_trace, shape
from tandem.bench.common import need_modules
from tandem.bench.record import ResultFile

# The pod start times the report sweeps, beside the calibration's measured ones (8B on an H100: 51 s
# with a warm compile cache, 105 s with an empty one): 15 s, what a shared compile cache aims at;
# 45 s, about the warm start; 120 s, a little slower than the cold one.
START_S = (15.0, 45.0, 120.0)


def traces(shapes: list[str], seeds: list[int], hours: float) -> dict:
    out = {}
    for name in shapes:
        per_seed = {}
        for seed in seeds:
            tr = make_trace(shape(name, hours, seed))
            per_seed[str(seed)] = {
                "requests": int(tr.counts.sum()),
                "peak_rate_rps": round(float(tr.rate.max()), 1),
            }
        tr = make_trace(shape(name, min(hours, 0.01), seeds[0]))
        out[name] = {
            "config": {k: v for k, v in asdict(SHAPES[name]).items() if k not in ("hours", "seed")},
            "cohort_prompt_tokens": [round(p) for p in tr.prompt_tokens],
            "cohort_output_tokens": [round(o) for o in tr.output_tokens],
            "seeds": per_seed,
        }
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem bench autoscale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[7, 8, 9, 10])
    parser.add_argument(
        "--tune-shape",
        choices=[*SHAPES, "each"],
        default="each",
        help="the shape every scaler's target is tuned on (each: every shape on itself)",
    )
    parser.add_argument("--tune-seed", type=int, default=7)
    parser.add_argument(
        "--grid-points", type=int, default=None, help="sweep only this many targets of each grid"
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--price", type=float, default=3.5, help="USD per GPU-hour")
    parser.add_argument(
        "--start-s",
        "--cold-start-s",
        dest="start_s",
        type=float,
        nargs="+",
        default=list(START_S),
        help="seconds from asking for a pod to its serving; each is compared on its own",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        default=calibration.DEFAULT,
        help="the pods' calibration file (bench/autoscale/calibration/, built by "
        "python -m tandem.bench.autoscale.calibrate)",
    )
    parser.add_argument("--ttft-slo-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: bench/results/<date>_cpu_autoscale_<hours>h.json); the "
                        "markdown table beside it")
    parser.add_argument("--plot", type=Path, default=None,
                        help="the figure's path (default: --out with .png)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--one", choices=list(BY_NAME), help="run one cell and print it (writes no files)")
    parser.add_argument("--target", type=float, default=None, help="with --one: the scaler's target")
    parser.add_argument("--shape", choices=list(SHAPES), default="chat", help="with --one")
    parser.add_argument("--seed", type=int, default=7, help="with --one")
    parser.add_argument("--cost-ceiling", type=float, default=None, help="with --one: Tandem's cost ceiling")
    parser.add_argument(
        "--capacity-bias",
        type=float,
        default=1.0,
        help="what the pods' capacity gauge reads against their true capacity (1 = exact)",
    )
    parser.add_argument(
        "--no-burst-headroom", action="store_true", help="Tandem with scaling.burstHeadroom off"
    )
    parser.add_argument(
        "--no-day-before", action="store_true",
        help="Tandem begins each trace with nothing learned (default: with what it learned over "
        "another day of the same shape, as status.learnedBursts keeps it)",
    )
    parser.add_argument("--scale-down-window-s", type=float, default=None,
                        help="with --one: Tandem's scaling.scaleDownStabilizationSeconds (unset: derived)")
    parser.add_argument("--scale-down-window-starts", type=float, default=None,
                        help="with --one: pod starts in a derived scale-down window (default: the policy's)")
    args = parser.parse_args(argv)
    window_options = args.scale_down_window_s is not None or args.scale_down_window_starts is not None
    if window_options and not args.one:
        parser.error("--scale-down-window-* are for --one runs (the comparison runs the CRD's defaults)")
    if args.cost_ceiling is not None and not args.one:
        parser.error("--cost-ceiling is for --one runs (the comparison runs the CRD's defaults)")
    if args.one and args.target is None and BY_NAME[args.one].grid:
        parser.error(f"--one {args.one} needs --target ({BY_NAME[args.one].target_means})")
    return args


def one_cell(args: argparse.Namespace, setup: Setup) -> int:
    """--one: a single cell at each start time, printed."""
    for start in args.start_s:
        cell = Cell(args.one, args.target, args.shape, args.seed, args.hours, start_s=start)
        _, run = run_cell(cell, setup)
        extra = {"tandem_cost_ceiling": args.cost_ceiling, "calibration": setup.pod.name,
                 "tandem_day_before": setup.tandem_day_before,
                 "tandem_scale_down_window_s": args.scale_down_window_s,
                 "tandem_scale_down_window_starts": args.scale_down_window_starts}
        print(json.dumps({"cell": asdict(cell), **extra, **run.summary}))
    return 0


def result_shape(args: argparse.Namespace) -> str:
    """`24h` for every trace shape; else the hours and the shapes, such as `2h-chat+decode-heavy`."""
    shapes = "" if set(args.shapes) == set(SHAPES) else "-" + "+".join(args.shapes)
    return f"{args.hours:g}h{shapes}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    setup = Setup(
        pod=calibration.load(args.calibration),
        price_per_gpu_hour=args.price,
        ttft_slo_s=args.ttft_slo_s,
        tandem_cost_ceiling=args.cost_ceiling,
        capacity_bias=args.capacity_bias,
        tandem_burst_headroom=not args.no_burst_headroom,
        tandem_day_before=not args.no_day_before,
        tandem_scale_down_window_s=args.scale_down_window_s,
        tandem_scale_down_window_starts=args.scale_down_window_starts,
    )
    if args.one:
        return one_cell(args, setup)
    if not args.no_plot:
        need_modules("autoscale", "matplotlib", why=" to draw (--no-plot draws nothing)")
    result_file = ResultFile("autoscale", argv, "cpu", result_shape(args), args.out)
    started = time.monotonic()
    seeds = list(dict.fromkeys(args.seeds))
    report, runs = compare(
        setup, args.shapes, seeds, args.hours, None if args.tune_shape == "each" else args.tune_shape,
        args.tune_seed, args.grid_points, args.jobs,
        series=not args.no_plot, starts=args.start_s, log=True,
    )  # fmt: skip
    report = {
        "benchmark": "autoscale_fair",
        "hours": args.hours,
        "seeds": seeds,
        "traces": traces(args.shapes, seeds, args.hours),
        # by name (its content follows): where this machine keeps it is no fact of the result
        "calibration": {"file": Path(args.calibration).name, **calibration.read(args.calibration)},
        "max_num_seqs": 256,
        **report,
        "simulated_in_s": round(time.monotonic() - started, 1),
    }

    def draw(png: Path) -> Path:
        load = make_trace(shape(report["tuning"]["plotted"]["shape"], args.hours, args.tune_seed)).counts
        plot(report, runs, load, args.plot or png)
        return args.plot or png

    out = result_file.write(report, markdown, None if args.no_plot else draw)
    for key, part in report["by_start"].items():
        for name, per_seed in part["verdicts"].items():
            met = sum(v["target_met"] for v in per_seed.values())
            print(f"pods start in {key} s, {name}: target met on {met} of {len(per_seed)}", file=sys.stderr)
    print(f"wrote {out} and its markdown table in {report['simulated_in_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
