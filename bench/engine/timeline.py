"""Draw the stream stages of engine steps as a Gantt chart (PNG) from a Chrome/Perfetto trace.

`tandem bench gpu --timeline trace.json` records, for each engine it runs, every stage of every
step (prepare on the CPU; h2d, compute, d2h from CUDA events) as Chrome trace events: open the
JSON in https://ui.perfetto.dev or chrome://tracing, or draw a window of it here, one panel per
engine (sync and async side by side):

    tandem bench timeline trace.json --out timeline.png [--steps 8] [--skip 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.common import need_modules

LANES = ("prepare", "h2d", "compute", "d2h")
COLORS = {"prepare": "#7f7f7f", "h2d": "#1f77b4", "compute": "#2ca02c", "d2h": "#ff7f0e"}


def trace_events(engine: str, steps: list[dict]) -> list[dict]:
    """Chrome trace 'complete' events (microseconds) of one engine's steps.

    `steps`: one dict per step, stage name -> (start, end) in wall-clock seconds, plus the
    step's `index` and optional attributes under `args`.
    """
    events = []
    for step in steps:
        for lane in LANES:
            if step.get(lane) is None:
                continue
            start, end = step[lane]
            events.append({
                "name": lane, "ph": "X", "pid": engine, "tid": lane, "ts": start * 1e6,
                "dur": max(0.0, end - start) * 1e6, "args": {"step": step["index"], **step.get("args", {})},
            })
    return events


def draw(events: list[dict], out: Path, steps: int, skip: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_engine: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        by_engine[e["pid"]].append(e)
    fig, axes = plt.subplots(len(by_engine), 1, figsize=(12, 1.6 + 1.4 * len(by_engine)), squeeze=False)
    for ax, (engine, evs) in zip(axes[:, 0], sorted(by_engine.items()), strict=True):
        window = [e for e in evs if skip <= e["args"]["step"] < skip + steps]
        t0 = min(e["ts"] for e in window)
        for row, lane in enumerate(LANES):
            bars = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in window if e["tid"] == lane]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=COLORS[lane], edgecolor="white", linewidth=0.3)
        for e in window:  # step numbers on the compute bars
            if e["tid"] == "compute":
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, LANES.index("compute"), str(e["args"]["step"]),
                        ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(LANES)), LANES)
        ax.invert_yaxis()
        ax.set_title(engine, loc="left", fontsize=10)
        ax.set_xlabel("ms")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="Chrome trace JSON written by `tandem bench gpu --timeline`")
    ap.add_argument("--out", type=Path, default=Path("timeline.png"))
    ap.add_argument("--steps", type=int, default=8, help="steps to draw per engine")
    ap.add_argument("--skip", type=int, default=20, help="first step drawn (steady decode, after prefill)")
    a = ap.parse_args(argv)
    need_modules("timeline", "matplotlib", why=" to draw")
    data = json.loads(a.trace.read_text())
    draw(data["traceEvents"], a.out, a.steps, a.skip)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
