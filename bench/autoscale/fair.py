"""The fair comparison: every scaler a platform team would deploy, each at its best fixed target,
on three trace shapes and several seeds, at several pod start times, every cell reported.

Method (at each pod start time, on its own):
1. Sweep: each tuned scaler runs every target of its grid on one trace (the tuning shape and
   seed); the cheapest target that keeps >= 99% of minutes within the TTFT SLO is its target
   (if none does, the one with the most minutes within). Tandem's CRD defaults are not tuned.
   (With tuning per shape, each shape's sweep runs on that shape, at the same seed.)
2. Cells: every scaler at that target, on every shape and seed. Tandem begins each trace with what
   it learned over the day before (another trace of the same shape, seed + 1000, replayed first and
   kept as the operator keeps it, in status.learnedBursts); the other scalers learn nothing.
3. Verdict per shape and seed: Tandem (CRD defaults) meets the target when its minutes within
   the SLO are >= 99%, its scaling events <= 3 an hour, and its cost per million tokens <= that of
   the cheapest fair baseline that keeps >= 99% of minutes within the SLO. The naive HPA on GPU
   utilisation is reported beside the others as a reference and never enters a verdict: it holds
   maxReplicas all day, so "within the SLO" it would only ever set the price of maxReplicas.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Literal

from tandem.bench.autoscale.scalers import (
    KedaQueue,
    KnativeLike,
    MetricHPA,
    Scaler,
    TandemScaler,
    batch_fill_per_pod,
    capacity_utilization_per_pod,
    gpu_util_per_pod,
    running_per_pod,
)
from tandem.bench.autoscale.sim import Run, Setup, simulate
from tandem.bench.autoscale.trace import make_trace, shape
from tandem.operator.policy import ScalingTargets
from tandem.operator.spec import parse_spec

SLO_ATTAINMENT = 0.99
EVENTS_PER_HOUR = 3.0

# Wide enough that every shape's best target is inside: prefill-bound pods run few requests
# (a 2,000-token prompt takes 90 ms to prefill, its 40 tokens 0.4 s to decode)
FILL_GRID = (0.02, 0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.95)
REQUESTS_GRID = (4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 160.0, 192.0)  # per pod
# capacity utilisation: Tandem's target (the tuned run) and the HPA's on the same gauge
UTILIZATION_GRID = (0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)
QUEUE_GRID = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # waiting requests per pod


def crd_defaults(setup: Setup) -> ScalingTargets:
    """The ModelServer's scaling targets as the CRD defaults them: only the bounds are set."""
    spec = parse_spec(
        {
            "image": "sim",
            "pricePerGpuHour": setup.price_per_gpu_hour,
            "scaling": {"minReplicas": setup.min_replicas, "maxReplicas": setup.max_replicas},
        }
    )
    return spec.targets()


def _tandem(target: float | None, setup: Setup) -> Scaler:
    targets = replace(
        crd_defaults(setup),
        cost_ceiling_usd_per_mtok=setup.tandem_cost_ceiling,
        burst_headroom=setup.tandem_burst_headroom,
        scale_down_stabilization_s=setup.tandem_scale_down_window_s,
    )
    if setup.tandem_scale_down_window_starts is not None:
        targets = replace(targets, scale_down_window_starts=setup.tandem_scale_down_window_starts)
    if target is not None:
        targets = replace(targets, target_utilization=target)
    return TandemScaler(targets, setup.price_per_gpu_hour * setup.gpus_per_pod)


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    target_means: str
    grid: tuple[float, ...] = ()  # swept targets; empty: run as configured (fixed below)
    fixed: float | None = None
    # baseline: a fair one, in the verdict; tandem: Tandem's own; reference: reported apart, never
    # in a verdict
    kind: Literal["baseline", "tandem", "reference"] = "baseline"

    def make(self, target: float | None, setup: Setup) -> Scaler:
        scaler = FACTORIES[self.name](target if target is not None else self.fixed, setup)
        scaler.name = self.name
        return scaler


FACTORIES: dict[str, Callable[[float | None, Setup], Scaler]] = {
    "tandem_default": _tandem,
    "tandem_tuned": _tandem,
    "hpa_running": lambda t, s: MetricHPA("", running_per_pod, t, s.min_replicas, s.max_replicas),
    "hpa_batch_fill": lambda t, s: MetricHPA("", batch_fill_per_pod, t, s.min_replicas, s.max_replicas),
    "hpa_capacity": lambda t, s: MetricHPA(
        "", capacity_utilization_per_pod, t, s.min_replicas, s.max_replicas
    ),
    "keda_queue": lambda t, s: KedaQueue(t, s.min_replicas, s.max_replicas),
    "knative_concurrency": lambda t, s: KnativeLike(s.min_replicas, s.max_replicas, target=t),
    "hpa_gpu_util": lambda t, s: MetricHPA("", gpu_util_per_pod, t, s.min_replicas, s.max_replicas),
}

CONTENDERS = (
    Contender(
        "tandem_default", "Tandem, CRD defaults", "none (targetCapacityUtilization 0.7)", kind="tandem"
    ),
    Contender(
        "tandem_tuned",
        "Tandem, targetCapacityUtilization tuned",
        "targetCapacityUtilization",
        UTILIZATION_GRID,
        kind="tandem",
    ),
    Contender("hpa_running", "HPA, running requests", "running requests per pod", REQUESTS_GRID),
    Contender("hpa_batch_fill", "HPA, batch fill", "batch fill per pod", FILL_GRID),
    Contender(
        "hpa_capacity",
        "HPA, capacity utilization",
        "tandem_capacity_utilization per pod",
        UTILIZATION_GRID,
    ),
    Contender("keda_queue", "KEDA, queue length", "waiting requests per pod", QUEUE_GRID),
    Contender(
        "knative_concurrency", "Knative-like, concurrency", "in-flight requests per pod", REQUESTS_GRID
    ),
    Contender(
        "hpa_gpu_util",
        "HPA, GPU utilisation (naive)",
        "GPU utilisation (not tuned)",
        fixed=0.7,
        kind="reference",
    ),
)
BY_NAME = {c.name: c for c in CONTENDERS}
BASELINES = tuple(c.name for c in CONTENDERS if c.kind == "baseline")


@dataclass(frozen=True)
class Cell:
    contender: str
    target: float | None
    shape: str
    seed: int
    hours: float
    series: bool = False  # keep pods per second and p95 per minute (for the plot)
    start_s: float | None = None  # the pods' start (None: the setup's)


# The day before a trace of seed s is the trace of seed s + DAY_BEFORE_SEED (the same shape): another
# day of the same traffic, none of the compared seeds
DAY_BEFORE_SEED = 1000


def run_cell(cell: Cell, setup: Setup) -> tuple[Cell, Run]:
    if cell.start_s is not None:
        setup = replace(setup, cold_start_s=cell.start_s)
    trace = make_trace(shape(cell.shape, cell.hours, cell.seed))
    scaler = BY_NAME[cell.contender].make(cell.target, setup)
    if isinstance(scaler, TandemScaler) and setup.tandem_day_before:
        remember_the_day_before(scaler, cell, setup)
    return cell, simulate(trace, scaler, setup, series=cell.series)


def remember_the_day_before(scaler: TandemScaler, cell: Cell, setup: Setup) -> None:
    """Start `scaler` with what the same policy learned over the day before (status.learnedBursts,
    as the operator keeps it): an operator that ran yesterday knows its bursts and its pods' start."""
    before = make_trace(shape(cell.shape, cell.hours, cell.seed + DAY_BEFORE_SEED))
    yesterday = BY_NAME[cell.contender].make(cell.target, setup)
    assert isinstance(yesterday, TandemScaler)
    simulate(before, yesterday, setup)
    if yesterday.state is not None:
        scaler.remember(yesterday.state.bursts.as_status(), float(before.seconds))


def run_cells(cells: list[Cell], setup: Setup, jobs: int, log: bool = False) -> dict[Cell, Run]:
    done: dict[Cell, Run] = {}

    def note(cell: Cell, run: Run) -> None:
        done[cell] = run
        if log:
            s = run.summary
            start = "" if cell.start_s is None else f"start {cell.start_s:g} s "
            print(
                f"[{len(done)}/{len(cells)}] {start}{cell.shape} seed {cell.seed} {cell.contender} "
                f"{_target(cell.target)}: ${s['cost_per_million_tokens_usd']:.3f}/Mtok, "
                f"{s['ttft_p95_slo_attainment']:.2%} of minutes, {s['scaling_events_per_hour']} events/h",
                file=sys.stderr,
            )

    if jobs <= 1:
        for c in cells:
            note(*run_cell(c, setup))
        return done
    with ProcessPoolExecutor(jobs) as pool:
        for cell, run in pool.map(run_cell, cells, [setup] * len(cells), chunksize=1):
            note(cell, run)
    return done


def _target(value: float | None) -> str:
    return "default" if value is None else f"{value:g}"


def choose(sweep: dict[float, dict]) -> float:
    """The cheapest target within the SLO attainment; if none is, the one most within it."""
    within = [t for t, s in sweep.items() if s["ttft_p95_slo_attainment"] >= SLO_ATTAINMENT]
    if within:
        return min(within, key=lambda t: (sweep[t]["cost_per_million_tokens_usd"], t))
    return max(
        sweep, key=lambda t: (sweep[t]["ttft_p95_slo_attainment"], -sweep[t]["cost_per_million_tokens_usd"])
    )


def verdict(cells: dict[str, dict]) -> dict:
    """Tandem's defaults against the fair baselines on one trace (one shape, one seed)."""
    tandem = cells["tandem_default"]
    baselines = {n: s for n, s in cells.items() if BY_NAME[n].kind == "baseline"}
    within = {n: s for n, s in baselines.items() if s["ttft_p95_slo_attainment"] >= SLO_ATTAINMENT}
    calm = {n: s for n, s in within.items() if s["scaling_events_per_hour"] <= EVENTS_PER_HOUR}

    def cheapest(group: dict[str, dict]) -> str | None:
        return min(group, key=lambda n: group[n]["cost_per_million_tokens_usd"]) if group else None

    best, best_calm = cheapest(within), cheapest(calm)
    cost = tandem["cost_per_million_tokens_usd"]
    out = {
        "tandem_cost": cost,
        "tandem_slo_attainment": tandem["ttft_p95_slo_attainment"],
        "tandem_events_per_hour": tandem["scaling_events_per_hour"],
        "tandem_meets_slo": tandem["ttft_p95_slo_attainment"] >= SLO_ATTAINMENT,
        "tandem_meets_events": tandem["scaling_events_per_hour"] <= EVENTS_PER_HOUR,
        "best_baseline": best,
        "best_baseline_cost": baselines[best]["cost_per_million_tokens_usd"] if best else None,
        "best_calm_baseline": best_calm,
        "best_calm_baseline_cost": baselines[best_calm]["cost_per_million_tokens_usd"] if best_calm else None,
    }
    out["tandem_cost_vs_best"] = round(cost / out["best_baseline_cost"] - 1, 4) if best else None
    out["tandem_cost_at_most_best"] = best is None or cost <= out["best_baseline_cost"]
    out["target_met"] = (
        out["tandem_meets_slo"] and out["tandem_meets_events"] and out["tandem_cost_at_most_best"]
    )
    return out


def _grid(c: Contender, points: int | None) -> tuple[float, ...]:
    """`points` targets of the contender's grid, spread over it (None: all)."""
    if points is None or points >= len(c.grid):
        return c.grid
    step = (len(c.grid) - 1) / max(points - 1, 1)
    return tuple(c.grid[round(i * step)] for i in range(points))


def compare(
    setup: Setup,
    shapes: list[str],
    seeds: list[int],
    hours: float,
    tune_shape: str | None,
    tune_seed: int,
    grid_points: int | None,
    jobs: int,
    series: bool,
    starts: list[float] | None = None,
    log: bool = False,
) -> tuple[dict, dict[Cell, Run]]:
    """Sweep, choose, run every cell, at every pod start time in `starts` (None: the setup's); the
    report and the runs. `tune_shape` None: every shape's targets are tuned on that shape (at
    `tune_seed`), not on one shape for all. Each start time is tuned on its own: a platform team
    tunes for the pods it has."""
    starts = list(dict.fromkeys(starts or [setup.cold_start_s]))
    tuned_on = {sh: tune_shape or sh for sh in shapes}
    # the figure: the tuning trace, at the start time nearest the pods' measured (warm) start
    plotted = {
        "shape": tune_shape or shapes[0],
        "seed": tune_seed,
        "start_s": min(starts, key=lambda st: abs(st - setup.pod.start_s_warm)),
    }
    keep = lambda sh, sd, st: series and (sh, sd, st) == tuple(plotted.values())  # noqa: E731
    sweep_cells = [
        Cell(c.name, t, sh, tune_seed, hours, keep(sh, tune_seed, st), st)
        for st in starts
        for sh in dict.fromkeys(tuned_on.values())
        for c in CONTENDERS
        for t in _grid(c, grid_points)
    ]
    runs = run_cells(sweep_cells, setup, jobs, log)
    sweeps: dict[float, dict[str, dict[str, dict[float, dict]]]] = {}
    for cell, run in runs.items():
        per = sweeps.setdefault(cell.start_s, {}).setdefault(cell.shape, {})
        per.setdefault(cell.contender, {})[cell.target] = run.summary
    chosen = {
        st: {
            sh: {c.name: choose(sweeps[st][tuned_on[sh]][c.name]) if c.grid else c.fixed for c in CONTENDERS}
            for sh in shapes
        }
        for st in starts
    }
    cells = [
        Cell(c.name, chosen[st][sh][c.name], sh, sd, hours, keep(sh, sd, st), st)
        for st in starts
        for sh in shapes
        for sd in seeds
        for c in CONTENDERS
    ]
    runs.update(run_cells([c for c in cells if c not in runs], setup, jobs, log))

    by_start = {}
    for st in starts:
        results: dict[str, dict[str, dict[str, dict]]] = {}
        for cell in cells:
            if cell.start_s == st:
                results.setdefault(cell.shape, {}).setdefault(str(cell.seed), {})[cell.contender] = runs[
                    cell
                ].summary
        verdicts = {sh: {sd: verdict(by) for sd, by in per.items()} for sh, per in results.items()}
        by_start[f"{st:g}"] = {
            "start_s": st,
            "targets": {c.name: {sh: chosen[st][sh][c.name] for sh in shapes} for c in CONTENDERS},
            "sweep": {
                sh: {
                    name: {str(t): s for t, s in sorted(by.items())}
                    for name, by in per.items()
                    if BY_NAME[name].grid
                }
                for sh, per in sweeps[st].items()
            },
            "results": results,
            "verdicts": verdicts,
            "summary": {sh: summarize(per, verdicts[sh]) for sh, per in results.items()},
        }
    report = {
        "method": __doc__.strip(),
        "setup": {k: v for k, v in asdict(setup).items() if k not in ("pod", "cold_start_s")}
        | {"pod": setup.pod.name},
        "slo_attainment_required": SLO_ATTAINMENT,
        "events_per_hour_allowed": EVENTS_PER_HOUR,
        "tuning": {"seed": tune_seed, "tuned_on": tuned_on, "plotted": plotted},
        "contenders": {
            c.name: {
                "label": c.label,
                "target_means": c.target_means,
                "kind": c.kind,
                "grid": list(_grid(c, grid_points)),
            }
            for c in CONTENDERS
        },
        "tandem_defaults": asdict(crd_defaults(setup)),
        "start_s": starts,
        "by_start": by_start,
    }
    return report, runs


def summarize(per_seed: dict[str, dict[str, dict]], verdicts: dict[str, dict]) -> dict:
    """One trace shape over its seeds."""

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 4)

    names = list(next(iter(per_seed.values())))
    scalers = {}
    for n in names:
        cost = [s[n]["cost_per_million_tokens_usd"] for s in per_seed.values()]
        slo = [s[n]["ttft_p95_slo_attainment"] for s in per_seed.values()]
        events = [s[n]["scaling_events_per_hour"] for s in per_seed.values()]
        scalers[n] = {
            "mean_cost_per_million_tokens_usd": mean(cost),
            "min_slo_attainment": min(slo),
            "mean_slo_attainment": mean(slo),
            "max_events_per_hour": max(events),
            "mean_events_per_hour": mean(events),
            "seeds_within_slo": sum(x >= SLO_ATTAINMENT for x in slo),
        }
    return {
        "seeds": len(per_seed),
        "target_met_on_seeds": sum(v["target_met"] for v in verdicts.values()),
        "scalers": scalers,
    }
