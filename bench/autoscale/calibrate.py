"""Build the autoscaling simulation's calibration file (read by bench/autoscale/calibration.py) from
measured `tandem bench` results, so that the simulated pod is the pod those results measured.

    python -m tandem.bench.autoscale.calibrate \\
        --decode bench/results/2026-12-06_h100_fp8_8b-bf16-w8a8+kv8-4-workloads.json \\
        --prefill bench/results/2026-12-05_h100_workloads_8b-mixed-long.json \\
        --start bench/results/2026-12-06_h100_start_8b.json

Where each number comes from:
- **Decode step**: each workload `RxP+N` of the decode results (`tandem bench fp8`, its bf16 variant;
  or `tandem bench gpu` files, one workload each) gives its median step at R sequences, each
  attending P + N/2 tokens on average. The K/V read per cached token is the slope of the same
  results' roofline (its mean step against the tokens attended: a token's K/V bytes over the copy
  bandwidth measured in the run). A point of the curve is a median step less its K/V reads; where
  several workloads share a batch size, the median of theirs. Workloads whose rows attend more than
  `--check-context` tokens each are held out: their steps are mostly K/V reads, so they check the
  K/V term (the file records measured and predicted) rather than place the curve.
- **Prefill**: the mixed workload of `tandem bench workloads` (prompts mean 580 tokens, answers 250,
  each step up to the server's 2,048-token budget): the prompt tokens of its steps that carry
  prompts, over their device time less what their decode rows take, taken as the mean decode-only
  step of the run's bucket that holds the mixed steps' mean rows. So prefill is priced as the
  simulation spends it, beside decoding rows.
- **KV cache**: the server's `kv_cache_memory_fraction` default of the GPU memory its name states
  (the 80GB of `NVIDIA H100 80GB HBM3`, or `--gpu-memory-gb`) less the weights the results measured,
  over a token's K/V bytes: an estimate (the server sizes it from free memory after loading).
- **Start**: a `tandem bench start` result of the same shape on the same GPU: its `warm` run (a
  new pod on a compile cache another pod filled) and its `cold` run (an empty cache), launch to
  SERVING.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.autoscale.calibration import CALIBRATIONS, pod_model
from tandem.bench.record import RESULTS, short_gpu

CHECK_CONTEXT = 2048  # tokens attended per row above which a workload checks, not places, the curve


def _facts(record: dict) -> dict:
    env = record.get("environment", {})
    return {k: record.get(k) or env.get(k) for k in ("gpu", "date", "commit")}


def decode_workloads(record: dict) -> list[dict]:
    """(sequences, mean context per row, median step, mean roofline step) of each workload measured."""
    if record.get("benchmark") == "fp8":
        out = []
        for name, w in record["variants"]["bf16"]["workloads"].items():
            rows, prompt, new = map(int, re.fullmatch(r"(\d+)x(\d+)\+(\d+)", name).groups())
            out.append(
                {
                    "workload": name,
                    "rows": rows,
                    "context": prompt + new / 2,
                    "median_step_ms": w["median_step_ms"],
                    "roofline_step_ms": w["roofline_step_ms_mean"],
                }
            )
        return out
    if record.get("benchmark") == "gpu_sync":
        w = record["workload"]
        return [{"workload": f"{w['requests']}x{w['prompt_tokens']}+{w['new_tokens']}", "rows": w["requests"],
                 "context": w["prompt_tokens"] + w["new_tokens"] / 2,
                 "median_step_ms": record["tandem_compiled"]["step_ms"]["median"],
                 "roofline_step_ms": record["roofline"]["step_ms_mean"]}]  # fmt: skip
    raise ValueError(f"not a decode result (tandem bench fp8 or gpu): {record.get('benchmark')}")


def kv_read_s_per_token(workloads: list[dict]) -> float:
    """The roofline's slope: seconds per cached token attended (least squares over the workloads)."""
    xs = [w["rows"] * w["context"] for w in workloads]
    ys = [w["roofline_step_ms"] / 1e3 for w in workloads]
    return statistics.linear_regression(xs, ys).slope


def decode_curve(workloads: list[dict], kv_s: float, check_context: float) -> tuple[list, list]:
    """The curve's points (sequences, step seconds without K/V reads) and the held-out checks."""
    by_rows: dict[int, list[float]] = {}
    checks = []
    for w in workloads:
        kv = kv_s * w["rows"] * w["context"]
        if w["context"] > check_context:
            checks.append(w)
        else:
            by_rows.setdefault(w["rows"], []).append(w["median_step_ms"] / 1e3 - kv)
    points = [[rows, round(statistics.median(v), 7)] for rows, v in sorted(by_rows.items())]
    return points, checks


def prefill_rate(record: dict) -> dict:
    """Prompt tokens per second of the mixed workload's steps that carry prompts (see the module)."""
    tokens = seconds = 0.0
    prompt_only = [0.0, 0.0]
    for run in record["mixed"]:
        kinds = run["step_kinds"]
        mixed, prompt = kinds["mixed"], kinds["prompt"]
        rows = mixed["decode_rows_mean"]
        bucket = next(b for name, b in run["decode_by_rows"].items()
                      if int(name.split("-")[0]) <= rows <= int(name.split()[0].split("-")[1]))  # fmt: skip
        decode_s = mixed["steps"] * bucket["device_s"] / bucket["steps"]
        tokens += (
            mixed["steps"] * mixed["prompt_tokens_mean"] + prompt["steps"] * prompt["prompt_tokens_mean"]
        )
        seconds += mixed["device_s"] - decode_s + prompt["device_s"]
        prompt_only[0] += prompt["steps"] * prompt["prompt_tokens_mean"]
        prompt_only[1] += prompt["device_s"]
    return {
        "tokens_per_s": round(tokens / seconds),
        "prompt_only_steps_tokens_per_s": round(prompt_only[0] / prompt_only[1]) if prompt_only[1] else None,
        "runs": len(record["mixed"]),
    }


def gpu_memory_gb(gpu: str, given: float | None) -> float:
    if given is not None:
        return given
    found = re.search(r"(\d+)\s*GB", gpu)
    if not found:
        raise SystemExit(f"the GPU's name ({gpu}) states no memory: pass --gpu-memory-gb")
    return float(found.group(1))


def kv_cache_tokens(record: dict, gpu: str, memory_gb: float | None) -> dict:
    from tandem.service.settings import ServerSettings

    fraction = ServerSettings.model_fields["kv_cache_memory_fraction"].default
    memory = gpu_memory_gb(gpu, memory_gb)
    per_token = record["kv_KiB_per_token"] * 1024
    return {
        "tokens": round(fraction * (memory - record["weight_GB"]) * 1e9 / per_token),
        "gpu_memory_GB": memory,
        "weight_GB": record["weight_GB"],
        "kv_bytes_per_token": per_token,
        "kv_cache_memory_fraction": fraction,
    }


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(RESULTS.parent.parent))
    except ValueError:
        return str(path)


def start_times(record: dict, start: Path) -> dict:
    """A `tandem bench start` result's (`record`, read from `start`) launch-to-SERVING times, warm
    and cold cache."""
    runs = record.get("runs") or {}
    if record.get("benchmark") != "start" or not {"warm", "cold"} <= runs.keys():
        raise SystemExit(f"{start}: not a tandem bench start result with a cold and a warm run")
    return {"warm_cache_s": runs["warm"]["serving_s"], "cold_cache_s": runs["cold"]["serving_s"],
            "source": _relative(Path(start))}  # fmt: skip


def build(
    decode: Sequence[Path],
    prefill: Path,
    start: Path,
    check_context: float = CHECK_CONTEXT,
    memory_gb: float | None = None,
) -> dict:
    """The calibration record (calibration.py reads it) from the result files."""
    records = [json.loads(Path(p).read_text()) for p in decode]
    workloads = [w | {"source": Path(p).name} for p, r in zip(decode, records, strict=True)
                 for w in decode_workloads(r)]  # fmt: skip
    kv_s = kv_read_s_per_token(workloads)
    points, held_out = decode_curve(workloads, kv_s, check_context)
    prefill_record = json.loads(Path(prefill).read_text())
    facts = [_facts(r) for r in records]
    gpu = facts[0]["gpu"]
    start_record = json.loads(Path(start).read_text())
    if any(f["gpu"] != gpu for f in [*facts, _facts(prefill_record), _facts(start_record)]):
        raise SystemExit("the result files come from different GPUs")
    record = {
        "name": f"{max(f['date'] for f in facts)}_{short_gpu(gpu)}_8b",
        "date": max(f["date"] for f in facts),
        "gpu": gpu,
        "model": "Llama-3.1-8B shape, bf16 (random-init weights), the server's CUDA defaults",
        "commits": sorted({f["commit"] for f in [*facts, _facts(prefill_record), _facts(start_record)]}),
        "built_by": "python -m tandem.bench.autoscale.calibrate (bench/autoscale/calibrate.py)",
        "decode_step": {
            "sources": [_relative(Path(p)) for p in decode],
            "measured": [
                {k: w[k] for k in ("source", "workload", "rows", "context", "median_step_ms")}
                for w in workloads
            ],  # fmt: skip
            "kv_read_s_per_token": round(kv_s, 14),
            "points": points,
            "checks": [
                {
                    "workload": w["workload"],
                    "measured_ms": w["median_step_ms"],
                    "predicted_ms": None,
                }  # filled below, from the model as the simulation reads it
                for w in held_out
            ],  # fmt: skip
        },
        "prefill": {"source": _relative(Path(prefill)), **prefill_rate(prefill_record)},
        "kv_cache": kv_cache_tokens(prefill_record, gpu, memory_gb),
        "start": start_times(start_record, start),
    }
    model = pod_model(record, record["name"])
    for check, w in zip(record["decode_step"]["checks"], held_out, strict=True):
        check["predicted_ms"] = round(1e3 * model.step_s(w["rows"], w["rows"] * w["context"]), 3)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tandem.bench.autoscale.calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--decode",
        type=Path,
        nargs="+",
        required=True,
        help="tandem bench fp8 (its bf16 variant) or tandem bench gpu result files",
    )
    ap.add_argument("--prefill", type=Path, required=True, help="a tandem bench workloads result (mixed)")
    ap.add_argument("--start", type=Path, required=True,
                    help="a tandem bench start result (cold and warm runs) of the same GPU")
    ap.add_argument("--check-context", type=float, default=CHECK_CONTEXT)
    ap.add_argument("--gpu-memory-gb", type=float, default=None)
    ap.add_argument("--out", type=Path, default=None, help=f"default: {CALIBRATIONS}/<date>_<gpu>_8b.json")
    args = ap.parse_args(argv)
    record = build(args.decode, args.prefill, args.start, args.check_context, args.gpu_memory_gb)
    out = args.out or CALIBRATIONS / f"{record['name']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
