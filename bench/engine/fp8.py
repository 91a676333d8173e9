"""`tandem bench fp8`: the engine in bf16 beside the same engine in FP8, on several workload shapes,
in one run.

Each variant (bf16; w8a8 = FP8 linear layers; kv8 = FP8 KV cache; w8a8+kv8 = both) gets its own
random-initialised model of the shape (seed 0: the same weights) and its engine at the server's CUDA
settings, built once; every workload then runs on every engine: a few warm-up requests, then the
timed batch (greedy, each request exactly its new tokens). Per workload and variant: tokens/s, the
median step, the ratio to bf16 and the decode roofline of that variant's own bytes (its weights,
its K/V per token) at the measured copy bandwidth. `--gemm` adds the FP8 GEMM against bf16's on the
shape's layers at a few row counts (the kernel a decode step of that many rows runs, and
torch._scaled_mm's row-wise FP8 GEMM), and sweeps the small-row kernel's configurations (tile
widths, K steps, warps and stages, split-K) at up to 32 rows: which kernel each row count should get.

    tandem bench fp8 --shape 8b                                   # bf16 vs w8a8+kv8, 4 workloads
    tandem bench fp8 --shape 8b --variants bf16,w8a8,w8a8+kv8 --gemm
    tandem bench fp8 --smoke                                      # tiny model on CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Sequence

import torch

from tandem.bench.engine import inductor_options
from tandem.bench.engine.gpu_sync import roofline
from tandem.bench.engine.harness import blocks_for, copy_bandwidth, environment, run_tandem
from tandem.bench.engine.precision import NAMED, model_bytes
from tandem.bench.engine.variants import SERVER_CUDA, build_model
from tandem.bench.record import ResultFile
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.ops.kv_cache import CacheShape


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int
    prompt: int
    new: int

    @classmethod
    def parse(cls, text: str) -> Workload:  # "32x128+1024"
        requests, rest = text.split("x")
        prompt, new = rest.split("+")
        return cls(int(requests), int(prompt), int(new))

    def __str__(self) -> str:
        return f"{self.requests}x{self.prompt}+{self.new}"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", choices=["8b", "1b", "tiny"])
    ap.add_argument("--variants", default="bf16,w8a8+kv8",
                    help=f"of {', '.join(NAMED)}; the first is the base")
    ap.add_argument("--workloads", default="1x128+128,32x128+1024,256x128+256,8x512+4096",
                    help="REQUESTSxPROMPT+NEW, comma-separated")
    ap.add_argument("--gemm", action="store_true", help="also time the FP8 GEMMs against bf16's")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, short workloads")
    inductor_options.add_option(ap)
    ap.add_argument("--out", help="JSON path (default: bench/results/ under the standard name)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape, a.workloads = "tiny", "1x8+4,4x8+6"
    a.device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    a.dtype = torch.bfloat16 if a.device.type == "cuda" else torch.float32
    a.variant_list = a.variants.split(",")
    unknown = set(a.variant_list) - NAMED.keys()
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}: expected some of {sorted(NAMED)}")
    a.workload_list = [Workload.parse(w) for w in a.workloads.split(",")]
    return a


def engine_config(a: argparse.Namespace, variant: str) -> EngineConfig:
    # the cache of the workload that holds the most tokens at once (not the widest times the longest)
    blocks = max(blocks_for(w.requests, w.prompt + w.new, 16) for w in a.workload_list)
    widest = max(w.requests for w in a.workload_list)
    device_settings = {**SERVER_CUDA, "step_loop": "async"} if a.device.type == "cuda" else {}
    return EngineConfig(blocks, 16, max(widest, 8), 2048,
                        **device_settings, **NAMED[variant].engine())


def run_variant(a: argparse.Namespace, variant: str, bandwidth: float, record: dict,
                save: Callable[[], object]) -> None:
    """Build the variant's engine once, then time every workload on it, into `record`; `save` after each
    workload, so that a run cut short keeps what it measured."""
    start = time.perf_counter()
    model = build_model(a.shape, a.device, a.dtype)
    core = build_core(model, engine_config(a, variant))
    cache = core.runner.cache
    weight_bytes = model_bytes(model)
    kv_per_token = CacheShape.of(model.config).bytes_per_token(cache.k_store.dtype)
    record.update({"built_s": round(time.perf_counter() - start, 1),
                   "weight_GB": round(weight_bytes / 1e9, 3),
                   "kv_dtype": str(cache.k_store.dtype).removeprefix("torch."), "workloads": {}})
    print(f"{variant}: built in {record['built_s']} s, weights {record['weight_GB']} GB, "
          f"KV {record['kv_dtype']}", flush=True)
    g = torch.Generator().manual_seed(1)
    for w in a.workload_list:
        prompts = torch.randint(0, model.config.vocab_size - 2, (w.requests, w.prompt), generator=g).tolist()
        run_tandem(core, prompts[:8], min(8, w.new), tag="warm")
        stats = run_tandem(core, prompts, w.new, tag="t")
        roof = roofline(weight_bytes, kv_per_token, bandwidth, w.requests, w.prompt, w.new)
        record["workloads"][str(w)] = {
            "tok_s": round(stats.tok_s, 1), "median_step_ms": stats.step_ms.get("median"),
            "seconds": round(stats.seconds, 3), "steps": stats.steps, "step_ms": stats.step_ms,
            "slow_steps": stats.slow_steps,
            "roofline_tok_s": roof["tok_s"], "roofline_step_ms_mean": roof["step_ms_mean"],
            "of_roofline": round(stats.tok_s / roof["tok_s"], 3) if roof["tok_s"] else None,
            "outputs_head": [o[:8] for o in stats.outputs[:4]],
        }
        print(f"  {variant} {w}: {stats.tok_s:,.0f} tok/s, median step {stats.step_ms.get('median')} ms, "
              f"{record['workloads'][str(w)]['of_roofline']} of its roofline", flush=True)
        save()
    del core, model
    gc.collect()
    if a.device.type == "cuda":
        torch.cuda.empty_cache()


def gemm_times(a: argparse.Namespace) -> dict:
    """Microseconds of each layer's GEMM at a few row counts: bf16, the FP8 op (alone, and with the
    rows' quantization before it), torch._scaled_mm, and (at up to 32 rows) the small-row kernel's
    configurations. Timed as a decode step runs them:
    in a CUDA graph, each call reading a different copy of the weights (none served warm from the L2)."""
    from triton.testing import do_bench_cudagraph

    from tandem.bench.common import SHAPES
    from tandem.service.engine.ops.fp8_linear import SMALL_ROWS, quantize_rows, scaled_mm
    from tandem.service.engine.ops.triton_fp8_gemm import GemmConfig, default_config, fp8_gemm

    sweep = [GemmConfig(bn, bk, 4, st, sk) for bn in (32, 64) for bk in (128, 256) for st in (3, 4, 6)
             for sk in (1, 2, 4, 8)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def us(gemm: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
        def calls() -> None:
            for w in weights:
                gemm(w)
        return 1e3 * do_bench_cudagraph(calls, rep=30, return_mode="median") / len(weights)

    s = SHAPES[a.shape]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    kv = hidden // s["num_attention_heads"] * s["num_key_value_heads"]
    layers = {"qkv": (hidden + 2 * kv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter)}
    times: dict = {}
    for name, (n, k) in layers.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, n).contiguous()
        copies = max(2, -(-4 * 2**30 // (8 * n * k)))  # past any GPU's L2 (50-60 MB) many times over
        bf16_weights, fp8_weights = [w.clone() for _ in range(copies)], [wq.clone() for _ in range(copies)]
        for m in (1, 4, 16, 32, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            q = (xq, xs, ws)  # this row count's operands beside each copy of the weights
            row = {"bf16": us(lambda w, x=x: torch.nn.functional.linear(x, w), bf16_weights),
                   "fp8_op": us(lambda w, q=q: scaled_mm(q[0], q[1], w, q[2], torch.bfloat16), fp8_weights),
                   "fp8_rowwise_scaled_mm": us(lambda w, q=q: torch._scaled_mm(
                       q[0], w.t(), scale_a=q[1], scale_b=q[2], out_dtype=torch.bfloat16), fp8_weights)}
            row["fp8_op_with_row_quantization"] = us(
                lambda w, x=x, q=q: scaled_mm(*quantize_rows(x), w, q[2], torch.bfloat16), fp8_weights)
            if m <= SMALL_ROWS:  # the small-row kernel's configurations, split-K among them
                swept = {c: us(lambda w, c=c, q=q: fp8_gemm(q[0], q[1], w, q[2], torch.bfloat16, c),
                               fp8_weights) for c in sweep}
                best = min(swept, key=swept.get)
                row["fp8_best_configuration"] = swept[best]
                print(f"  GEMM {name} {n}x{k}, {m:3d} rows: best small-row configuration {best}: "
                      f"{swept[best]:.1f} us; the default {default_config(n, k, sms)}", flush=True)
                times[f"{name} {n}x{k}, {m} rows, small-row configurations"] = {
                    str(c): round(v, 1) for c, v in swept.items()}
            times[f"{name} {n}x{k}, {m} rows"] = {key: round(v, 1) for key, v in row.items()}
            print(f"  GEMM {name} {n}x{k}, {m:3d} rows: "
                  + ", ".join(f"{key} {v:.1f} us" for key, v in row.items())
                  + f"; FP8 op / bf16 {row['fp8_op'] / row['bf16']:.2f}", flush=True)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    try:
        inductor = inductor_options.apply(a.inductor)
    except ValueError as exc:
        print(f"tandem bench fp8: {exc}", file=sys.stderr)
        return 2
    result = ResultFile("fp8", argv, a.device, f"{a.shape}-{a.variants.replace(',', '-')}", a.out)
    bandwidth = copy_bandwidth(a.device, 2 * 1024**3 if a.device.type == "cuda" else 2**26)
    record: dict = {"benchmark": "fp8", "model": f"random-init Llama {a.shape} shape", "smoke": a.smoke,
                    "environment": environment(a.device), "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
                    "inductor": inductor, "variants": {}}
    for variant in a.variant_list:
        run_variant(a, variant, bandwidth, record["variants"].setdefault(variant, {}),
                    lambda: result.write(record))
    if a.gemm and a.device.type == "cuda":
        record["gemm_us"] = gemm_times(a)
    base = a.variant_list[0]
    record["ratio_to_" + base] = {
        v: {w: round(r["workloads"][w]["tok_s"] / record["variants"][base]["workloads"][w]["tok_s"], 3)
            for w in r["workloads"]} for v, r in record["variants"].items() if v != base}
    for v, ratios in record["ratio_to_" + base].items():
        print(f"{v} / {base}: " + ", ".join(f"{w} {x:.3f}" for w, x in ratios.items()))
    print(f"wrote {result.write(record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
