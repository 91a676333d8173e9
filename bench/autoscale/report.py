"""The fair comparison's report as markdown tables, and the plot of one trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.bench.autoscale.fair import BY_NAME, SLO_ATTAINMENT, Cell
from tandem.bench.autoscale.sim import Run


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _target(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(*names: str) -> list[str]:
    return [_row(*names), _row(*["---"] * len(names))]


def _brief(s: dict) -> str:
    """Cost, minutes within the SLO, events per hour."""
    cost, slo = s["cost_per_million_tokens_usd"], s["ttft_p95_slo_attainment"]
    return f"{cost:.3f}, {_pct(slo)}, {s['scaling_events_per_hour']:.2f}"


def sweep_table(part: dict, contenders: dict, shape: str, tuned_on: dict[str, str]) -> str:
    lines = []
    for name, by_target in part["sweep"][shape].items():
        c = contenders[name]
        chosen = part["targets"][name][next(sh for sh, on in tuned_on.items() if on == shape)]
        lines += [f"**{c['label']}** ({c['target_means']}; chosen: {_target(chosen)})", ""]
        lines += _header("target", "$ / million tokens", "minutes within SLO", "events / hour", "mean pods")
        for target, s in by_target.items():
            mark = "**" if float(target) == chosen else ""
            lines.append(
                _row(
                    f"{mark}{float(target):g}{mark}",
                    f"{s['cost_per_million_tokens_usd']:.3f}",
                    _pct(s["ttft_p95_slo_attainment"]),
                    f"{s['scaling_events_per_hour']:.2f}",
                    f"{s['mean_pods']:.2f}",
                )
            )
        lines.append("")
    return "\n".join(lines)


def _compared(contenders: dict) -> list[str]:
    """Tandem's rows and the fair baselines' (the naive reference has a table of its own)."""
    return [n for n, c in contenders.items() if c["kind"] != "reference"]


def cells_table(part: dict, contenders: dict, shape: str, names: list[str]) -> str:
    lines = _header(
        "scaler", "target", "seed", "$ / million tokens", "minutes within SLO", "events / hour", "mean pods",
        "peak pods",
    )  # fmt: skip
    for name in names:
        for seed, by in part["results"][shape].items():
            s = by[name]
            lines.append(
                _row(
                    contenders[name]["label"],
                    _target(part["targets"][name][shape]),
                    seed,
                    f"{s['cost_per_million_tokens_usd']:.3f}",
                    _pct(s["ttft_p95_slo_attainment"]),
                    f"{s['scaling_events_per_hour']:.2f}",
                    f"{s['mean_pods']:.2f}",
                    s["peak_pods"],
                )
            )
    return "\n".join(lines)


def verdict_table(part: dict) -> str:
    lines = _header(
        "shape", "seed", "Tandem, defaults: $/Mtok, SLO, events/h",
        "cheapest fair baseline within SLO: $/Mtok, SLO, events/h", "Tandem vs it",
        "cheapest fair baseline within SLO and <= 3 events/h", "target met",
    )  # fmt: skip
    for shape, per_seed in part["verdicts"].items():
        for seed, v in per_seed.items():
            cells = part["results"][shape][seed]
            best = calm = "none"
            if v["best_baseline"]:
                best = f"{BY_NAME[v['best_baseline']].label}: {_brief(cells[v['best_baseline']])}"
            if v["best_calm_baseline"]:
                calm = f"{BY_NAME[v['best_calm_baseline']].label}: {v['best_calm_baseline_cost']:.3f}"
            vs = "-" if v["tandem_cost_vs_best"] is None else f"{100 * v['tandem_cost_vs_best']:+.1f}%"
            met = "yes" if v["target_met"] else "**no**"
            lines.append(_row(shape, seed, _brief(cells["tandem_default"]), best, vs, calm, met))
    return "\n".join(lines)


def summary_table(part: dict, contenders: dict, names: list[str]) -> str:
    lines = _header(
        "shape", "scaler", "mean $ / Mtok", "minutes within SLO (worst seed)", "seeds >= 99%",
        "events / hour (worst seed)",
    )  # fmt: skip
    for shape, summary in part["summary"].items():
        for name in names:
            s = summary["scalers"][name]
            lines.append(
                _row(
                    shape,
                    contenders[name]["label"],
                    f"{s['mean_cost_per_million_tokens_usd']:.3f}",
                    _pct(s["min_slo_attainment"]),
                    f"{s['seeds_within_slo']} of {summary['seeds']}",
                    f"{s['max_events_per_hour']:.2f}",
                )
            )
    return "\n".join(lines)


def cheapest_fair(summary: dict, contenders: dict) -> str | None:
    """The fair baseline of lowest mean cost among those within the SLO on every seed."""
    fair = {
        n: s
        for n, s in summary["scalers"].items()
        if contenders[n]["kind"] == "baseline" and s["seeds_within_slo"] == summary["seeds"]
    }
    return min(fair, key=lambda n: fair[n]["mean_cost_per_million_tokens_usd"]) if fair else None


def start_table(report: dict) -> str:
    """Per pod start time and shape: Tandem's defaults beside the cheapest fair baseline."""
    contenders = report["contenders"]
    lines = _header(
        "pods start in", "shape", "Tandem, defaults: mean $/Mtok, seeds >= 99%, worst SLO, events/h (max)",
        "cheapest fair baseline within the SLO on every seed: mean $/Mtok, events/h (max)", "Tandem vs it",
        "target met",
    )  # fmt: skip
    for key, part in report["by_start"].items():
        for shape, summary in part["summary"].items():
            t = summary["scalers"]["tandem_default"]
            seeds = f"{t['seeds_within_slo']} of {summary['seeds']}"
            tandem = (
                f"{t['mean_cost_per_million_tokens_usd']:.3f}, {seeds}, {_pct(t['min_slo_attainment'])}, "
                f"{t['max_events_per_hour']:.2f}"
            )
            best, vs = cheapest_fair(summary, contenders), "-"
            other = "none"
            if best:
                b = summary["scalers"][best]
                other = (
                    f"{contenders[best]['label']} ({_target(part['targets'][best][shape])}): "
                    f"{b['mean_cost_per_million_tokens_usd']:.3f}, {b['max_events_per_hour']:.2f}"
                )
                ratio = t["mean_cost_per_million_tokens_usd"] / b["mean_cost_per_million_tokens_usd"]
                vs = f"{100 * (ratio - 1):+.1f}%"
            met = f"{summary['target_met_on_seeds']} of {summary['seeds']}"
            lines.append(_row(f"{float(key):g} s", shape, tandem, other, vs, met))
    return "\n".join(lines)


def calibration_line(report: dict) -> str:
    cal = report.get("calibration")
    if not cal:
        return ""
    d = cal["decode_step"]
    steps = ", ".join(f"{1e3 * s:.2f} ms at {b:g}" for b, s in d["points"])
    commits = ", ".join(cal["commits"])
    return (
        f"Pods: calibration `{cal['name']}` ({cal['gpu']}, {cal['date']}, commits {commits}): a decode "
        f"step {steps} sequences, plus {1e9 * d['kv_read_s_per_token']:.1f} ns per cached token attended; "
        f"prefill {cal['prefill']['tokens_per_s']:,} tokens/s; "
        f"KV cache {cal['kv_cache']['tokens']:,} tokens; "
        f"measured start {cal['start']['warm_cache_s']:g} s (compile cache warm), "
        f"{cal['start']['cold_cache_s']:g} s (empty)."
    )


def reference_table(part: dict) -> str:
    """The naive HPA on GPU utilisation beside Tandem: reported, never in a verdict."""
    lines = _header(
        "shape", "seed", "HPA on GPU utilisation 70%: $/Mtok, SLO, events/h", "mean pods",
        "Tandem, defaults: $/Mtok",
    )  # fmt: skip
    for shape, per_seed in part["results"].items():
        for seed, cells in per_seed.items():
            ref = cells["hpa_gpu_util"]
            tandem = cells["tandem_default"]["cost_per_million_tokens_usd"]
            lines.append(_row(shape, seed, _brief(ref), f"{ref['mean_pods']:.2f}", f"{tandem:.3f}"))
    return "\n".join(lines)


def start_section(report: dict, key: str) -> list[str]:
    part, contenders = report["by_start"][key], report["contenders"]
    names = _compared(contenders)
    parts = [
        f"## Pods start in {float(key):g} s",
        "",
        "### Verdict per trace (fair baselines only)",
        "",
        verdict_table(part),
        "",
        "### Summary per shape",
        "",
        summary_table(part, contenders, names),
        "",
        "### The naive reference (never in a verdict)",
        "",
        reference_table(part),
        "",
        "### Every cell",
        "",
    ]
    for shape in part["results"]:
        parts += [f"#### {shape}", "", cells_table(part, contenders, shape, names), ""]
    for shape in part["sweep"]:
        parts += [
            f"### Sweep on {shape}, seed {report['tuning']['seed']}",
            "",
            sweep_table(part, contenders, shape, report["tuning"]["tuned_on"]),
        ]
    return parts


def markdown(report: dict) -> str:
    parts = [
        f"# Autoscaling, fair comparison ({report['date']})",
        "",
        f"`{report['command']}`; SLO: p95 TTFT <= {report['setup']['ttft_slo_s']:g} s in a minute; "
        f"required: >= {SLO_ATTAINMENT:.0%} of minutes. {_tuning(report)}",
        "",
        calibration_line(report),
        "",
        "## By pod start time",
        "",
        start_table(report),
        "",
    ]
    for key in report["by_start"]:
        parts += start_section(report, key)
    return "\n".join(parts)


def _tuning(report: dict) -> str:
    tuned_on, seed = report["tuning"]["tuned_on"], report["tuning"]["seed"]
    if all(on == sh for sh, on in tuned_on.items()) and len(tuned_on) > 1:
        return f"Targets tuned on each shape at seed {seed}, then held fixed for its other seeds."
    return f"Targets tuned on {next(iter(tuned_on.values()))}, seed {seed}, then held fixed for every trace."


# what the plot shows (KEDA's 2 <-> 24 swings and the near-duplicates would hide the rest)
COLORS = {
    "hpa_gpu_util": "tab:red",
    "hpa_running": "tab:orange",
    "hpa_capacity": "tab:purple",
    "knative_concurrency": "tab:blue",
    "tandem_default": "tab:green",
}


def plot(report: dict, runs: dict[Cell, Run], load: np.ndarray, path: Path) -> None:
    """Pods and TTFT over the tuning trace, one line per scaler at its chosen target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = report["tuning"]["plotted"]
    shape, seed, start = plotted["shape"], plotted["seed"], plotted["start_s"]
    chosen = {n: t[shape] for n, t in report["by_start"][f"{start:g}"]["targets"].items()}
    shown = {
        cell.contender: run
        for cell, run in runs.items()
        if (cell.shape, cell.seed, cell.start_s, cell.target) == (shape, seed, start, chosen[cell.contender])
        and cell.series
        and cell.contender in COLORS
    }
    seconds = len(load)
    hours = np.arange(seconds) / 3600
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 8), sharex=True, height_ratios=[3, 2])
    ax_load = top.twinx()
    per_minute = load[: seconds // 60 * 60].reshape(-1, 60).mean(axis=1)
    ax_load.fill_between(np.arange(len(per_minute)) / 60, per_minute, color="0.88")
    ax_load.set_ylabel("requests / s (grey)")
    top.set_zorder(ax_load.get_zorder() + 1)
    top.patch.set_visible(False)
    for name in COLORS:
        if name not in shown:
            continue
        run = shown[name]
        label = report["contenders"][name]["label"]
        lw = 1.6 if name == "tandem_default" else 0.9
        top.step(hours, run.pods, where="post", color=COLORS[name], lw=lw, label=label)
        served, p95 = run.p95_minutes
        bottom.plot(np.nonzero(served)[0] / 60, np.maximum(p95, 1e-3), color=COLORS[name], lw=0.7)
    top.set_ylabel("pods (GPUs)")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(
        f"Pods over one day, {shape} trace, seed {seed}, pods start in {start:g} s, at the chosen targets "
        "(KEDA not shown)"
    )
    slo = report["setup"]["ttft_slo_s"]
    bottom.axhline(slo, color="k", ls="--", lw=0.8, label=f"SLO {slo:g} s")
    bottom.set_yscale("log")
    bottom.set_ylabel("TTFT p95 per minute, s")
    bottom.set_xlabel("hour of day")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
