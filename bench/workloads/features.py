"""`tandem bench workloads`: the engine on real-shaped workloads, each side by side with the feature it
needs turned off, in one run.

    tandem bench workloads [--shape 8b] [--workloads mixed,prefix,oversubscribed,long] [--seeds 1,2,3]
    tandem bench workloads --smoke      # tiny shape on CPU: checks the logic, numbers meaningless
    tandem bench workloads --model --budgets 1024,2048,4096   # any host: exact schedules, modelled steps

One engine core at the server's CUDA settings (compiled decode and prefill forwards, CUDA graphs,
fused projections, cuBLASLt, rotary in the decode kernel, the asynchronous loop, the server's step
budget and sequence cap) is built once; each run gets a fresh scheduler over the same device cache
(its own block count, prefix caching on or off, a host pool or none), so the runs differ in nothing
else. Every request runs to its max_tokens (ignore_eos), greedy, all submitted at once.

- `mixed`: a ShareGPT-like mix (prompts.py's log-normal lengths: prompts 16-2,048, mean
  ~580; answers 8-1,024, mean ~250), one run per seed. Its **additive bound**: the run's decode steps'
  memory traffic (every weight, plus each decoding sequence's K/V) at the copy bandwidth, plus its
  prompt tokens' GEMM work (2 x linear parameters per token) at the dense bf16 GEMM rate measured in
  the same run. `of bound` = bound / measured time. Each step is also put in one of three kinds
  (decode only, prompt only, mixed) with its device time and its host preparation time.
  `--budgets 2048,4096`: each seed again at each step token budget (the most tokens a step takes,
  so the chunk size of long prompts), on the same engine. Every run reports TTFT, TPOT (per
  request: its tokens' span over their number less one) and inter-token latency percentiles, as
  the host receives the tokens: a larger budget trades inter-token latency for fewer steps.
- `prefix`: `--prefixes` system prompts of `--prefix-len` tokens, each shared by the same number of
  requests (a distinct 64-token question each, in a random order), in a cache that holds only some
  of the prefixes beside the running requests, so cached blocks are evicted: prefix caching on vs off.
- `oversubscribed`: more live context than the KV cache holds (`--oversub`, several shapes): preempted
  requests' K/V offloaded to a host pool of `--offload-gib` vs recomputed (prefix caching on in both,
  as the server runs); the tokens of the two are compared. Its **ratio bound**: what the ratio would
  be if offloading cost nothing and recomputing cost only its GEMMs: the recompute run's time over
  that time less the GEMM work of its extra prompt tokens (those it processed beyond the offload run's).
- `long`: few requests, very long generations (8 x 512 prompt x 16,384 new): tokens/s and the share
  of the decode roofline (every weight and every sequence's K/V per step at the copy bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.bench.common import SHAPES, markdown_table, need_cuda
from tandem.bench.engine.gemm_floor import StepGemmFloor
from tandem.bench.engine.harness import StallWatch, copy_bandwidth, environment
from tandem.bench.engine.host_step import no_forward
from tandem.bench.engine.precision import add_options, model_bytes, precisions
from tandem.bench.engine.variants import SERVER_CUDA, build_model
from tandem.bench.prompts import Workload, fixed, mixed, shared_prefixes
from tandem.bench.record import ResultFile
from tandem.bench.workloads.bounds import (
    Device,
    decode_by_rows,
    device_busy,
    fp8_gemm_rate,
    gemm_floor,
    gemm_rate,
    linear_params,
    modelled_device,
    step_kinds,
)
from tandem.bench.workloads.timed_run import BLOCK, BUDGET, MAX_NUM_SEQS, Run, fresh_scheduler, run
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.gc_pauses import freeze_start_up_heap

CACHE_GIB = 60.0  # on an H200 the mixed workload's 512 requests run without preemption
CACHE_SHARE = 0.8  # of the free memory: the rest for step buffers, compiled forwards and CUDA graphs


def cache_gib_that_fits(device: torch.device) -> float:
    """The default device cache: CACHE_GIB, or CACHE_SHARE of the free memory where that is less
    (an 80 GB card holds 8B's weights and about 50 GiB of cache). Measured after the rates' buffers
    are released."""
    if device.type != "cuda":
        return CACHE_GIB
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return min(CACHE_GIB, round(CACHE_SHARE * free / 2**30, 1))


def oversubscribed_shape(spec: str) -> tuple[int, int, int, float]:
    """`--oversub`'s REQUESTSxPROMPT+NEW@R -> requests, prompt tokens, new tokens, R (live context
    over what the cache holds)."""
    shape, ratio = spec.split("@")
    count, rest = shape.split("x")
    prompt, new = (int(x) for x in rest.split("+"))
    return int(count), prompt, new, float(ratio)


def schedule_model(shape: str, seeds: list[int], budgets: list[int], requests: int, cache_gib: float) -> dict:
    """The mixed workload's exact schedules (the engine's scheduler, the forward replaced by a token
    fill: `tandem bench host`'s) at each budget, each step at the additive bound of `shape` on the
    H200's measured rates: what a budget changes in steps, bound and the longest gap a decoding
    sequence sees, on any host, before a GPU run measures it."""
    modelled = "8b" if shape == "tiny" else shape
    device = modelled_device(modelled, 4.25e12, 735e12)
    tiny = build_model("tiny", torch.device("cpu"), torch.float32)  # its forward never runs
    blocks = int(cache_gib * 2**30) // (device.kv_per_token * BLOCK)
    config = EngineConfig(num_blocks=blocks, block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS,
                          max_num_batched_tokens=max(budgets), max_model_len=4096 + BLOCK,
                          step_loop="async", prefix_caching=True)
    core = build_core(tiny, config)
    no_forward(core)
    rows = []
    for seed, budget in [(s, b) for s in seeds for b in budgets]:
        fresh_scheduler(core, config, blocks, True, 0, budget)
        # the GPU run's vocabulary: the mixed workload draws its lengths and token ids from one stream
        work = mixed(requests, SHAPES[modelled]["vocab_size"], 4096, seed)
        r = run(core, work, f"model{seed}_{budget}")
        with_decodes = [device.step_bound_s(s) for s in r.steps if s["decode_rows"]]
        rows.append({
            "seed": seed, "budget": budget, "steps": len(r.steps),
            "mixed_steps": sum(s["kind"] == "mixed" for s in r.steps),
            "bound_s": round(device.bound_s(r.steps), 3),
            "decode_memory_s": round(sum(map(device.decode_memory_s, r.steps)), 3),
            "longest_decode_step_ms": round(1e3 * max(with_decodes), 1),
        })
    return {"benchmark": "workloads_model", "environment": environment(torch.device("cpu")),
            "modelled": {"shape": modelled, "bandwidth_TBps": 4.25, "gemm_TFLOPs": 735.0},
            "mixed_model": rows}


@dataclass
class Bench:
    """One engine core at the server's settings, its device's limits, and the run's options: each
    run gets a fresh scheduler over the core's cache."""

    a: argparse.Namespace
    core: object
    config: EngineConfig
    cache_blocks: int
    limits: Device
    floor: StepGemmFloor
    vocab: int

    def timed(
        self,
        name: str,
        work: Workload,
        num_blocks: int,
        prefix: bool,
        host: int,
        profile: tuple[int, int] | None = None,
        host_profile: bool = False,
        budget: int | None = None,  # None: the first of --budgets, as every workload but mixed runs
    ) -> Run:
        fresh_scheduler(self.core, self.config, num_blocks, prefix, host, budget or self.a.budgets[0])
        with StallWatch() as stalls:
            result = run(self.core, work, name, profile, host_profile)
        result.stalls = stalls.seen
        print(f"{name}: {result.summary()}", file=sys.stderr, flush=True)
        return result


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench workloads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["8b", "1b", "tiny"], default="8b")
    ap.add_argument("--workloads", default="mixed,prefix,oversubscribed,long")
    ap.add_argument("--seeds", default="1,2,3", help="mixed: one run per seed")
    ap.add_argument(
        "--budgets",
        default=str(BUDGET),
        help="mixed: one run per seed at each step token budget (chunk size), on the same engine",
    )
    ap.add_argument("--requests", type=int, default=512, help="mixed: requests per run")
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--per-prefix", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument(
        "--prefix-cache-share",
        type=float,
        default=0.5,
        help="prefix: the cache holds this share of all the prefixes plus the running requests",
    )
    ap.add_argument(
        "--oversub",
        default="128x1024+512@2,48x256+2048@3",
        help="oversubscribed workloads, REQUESTSxPROMPT+NEW@R: R = live context / what the cache holds",
    )
    ap.add_argument("--offload-gib", type=float, default=16.0)
    ap.add_argument("--long-requests", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--long-new", type=int, default=16384)
    ap.add_argument(
        "--profile",
        default=None,
        metavar="FIRST:STEPS",
        help="mixed, first seed: profile these steps' kernels (torch.profiler)",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="mixed, first seed: a run of its own with the mixed steps' launches under cProfile",
    )
    ap.add_argument(
        "--cache-gib",
        type=float,
        default=None,
        help=f"the device cache all runs share; default: {CACHE_GIB:g} GiB, or less where the device's "
        f"free memory after the model and the rates' buffers is smaller ({CACHE_SHARE * 100:.0f}%% of it)",
    )
    add_options(ap)  # --quantization, --kv-cache-dtype: one engine, every workload at that precision
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_<gpu>_workloads_<shape>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, few tokens: checks the logic")
    ap.add_argument(
        "--model",
        action="store_true",
        help="mixed only, any host: each seed's exact schedule at each budget (the forward replaced), its "
        "steps at the additive bound of --shape on the H200's measured rates",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape, a.requests, a.seeds = "tiny", 12, "1"
        a.prefixes, a.per_prefix, a.prefix_len = 3, 4, 64
        a.oversub = "12x48+24@2,6x16+64@3"
        a.long_requests, a.long_prompt, a.long_new = 2, 16, 64
        a.cache_gib, a.offload_gib = 0.05, 0.02
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.budgets = [int(b) for b in a.budgets.split(",")]
    a.workloads = a.workloads.split(",")
    return a


def model_schedules(a: argparse.Namespace, argv: Sequence[str]) -> int:
    """--model: the mixed workload's schedules at each budget, at the modelled device's bound."""
    result_file = ResultFile("workloads", argv, "cpu", f"{a.shape}-model", a.out)
    report = schedule_model(a.shape, a.seeds, a.budgets, a.requests, a.cache_gib or CACHE_GIB)
    print(markdown_table(
        ["seed", "budget", "steps", "mixed steps", "bound (s)", "longest step with decodes (ms)"],
        [[r["seed"], r["budget"], r["steps"], r["mixed_steps"], r["bound_s"], r["longest_decode_step_ms"]]
         for r in report["mixed_model"]]))
    print(f"wrote {result_file.write(report)}", file=sys.stderr)
    return 0


def build_bench(a: argparse.Namespace) -> tuple[Bench, dict]:
    """The model, its device's limits, and the one core every run shares; the report's header."""
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    model = build_model(a.shape, device, dtype)
    (precision,) = precisions(a)
    kv = precision.kv_bytes_per_token(model.config, dtype)  # FP8: twice the blocks in the same GiB
    fp8 = precision.quantization == "fp8"
    limits = Device(
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        linear_params=linear_params(model),
        kv_per_token=kv,
        bandwidth=copy_bandwidth(device) if device.type == "cuda" else 1e10,
        # prompts at the rate of the GEMMs the engine runs them with: FP8 weights, FP8's
        gemm_flops=fp8_gemm_rate(device, dtype) if fp8 else gemm_rate(device, dtype),
    )
    if a.cache_gib is None:
        a.cache_gib = cache_gib_that_fits(device)
    cache_blocks = int(a.cache_gib * 2**30) // (kv * BLOCK)
    config = EngineConfig(
        num_blocks=cache_blocks,
        block_size=BLOCK,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=max(a.budgets),  # the step buffers hold the largest budget's steps
        max_model_len=max(4096, a.long_prompt + a.long_new + BLOCK),
        prefix_caching=True,
        kv_offload_blocks=int(a.offload_gib * 2**30) // (kv * BLOCK),
        **({} if a.smoke else {**SERVER_CUDA, "step_loop": "async"}),
        **precision.engine(),
    )
    built = time.perf_counter()
    core = build_core(model, config)
    if precision.quantization != "none":  # the bounds read the weights as the engine holds them
        limits = dataclasses.replace(limits, weight_bytes=model_bytes(model))
    floor = StepGemmFloor(model, kv, limits.bandwidth)
    header = {
        "benchmark": "workloads",
        "environment": environment(device),
        "shape": a.shape,
        "engine": {
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": a.budgets[0],
            "mixed_budgets": a.budgets,
            "block_size": BLOCK,
            "cache_gib": a.cache_gib,
            "build_s": round(time.perf_counter() - built, 1),
            **({} if a.smoke else SERVER_CUDA),
            "quantization": precision.quantization,
            "kv_cache_dtype": precision.kv_cache_dtype,
        },
        "copy_bandwidth_TBps": round(limits.bandwidth / 1e12, 3),
        "gemm_TFLOPs": round(limits.gemm_flops / 1e12, 1),
        "gemm_precision": "fp8" if fp8 else str(dtype).removeprefix("torch."),
        "weight_GB": round(limits.weight_bytes / 1e9, 3),
        "kv_KiB_per_token": kv / 1024,
    }
    return Bench(a, core, config, cache_blocks, limits, floor, model.config.vocab_size), header


def mixed_runs(b: Bench, report: dict, rows: list[list[object]]) -> None:
    """`mixed`: one run per seed and budget against its additive bound and GEMM floor; the profiled
    runs (--profile, --host-profile) each a run of its own, the profilers slowing what they record."""
    a = b.a
    report["mixed"] = []
    for seed, budget in [(s, bud) for s in a.seeds for bud in a.budgets]:
        work = mixed(a.requests, b.vocab, 4096, seed)
        r = b.timed(f"mixed{seed}_{budget}", work, b.cache_blocks, True, 0, budget=budget)
        bound = b.limits.additive_bound(r.steps)
        floor_s = gemm_floor(r.steps, b.floor)
        report["mixed"].append(
            {
                "seed": seed,
                "budget": budget,
                "requests": a.requests,
                "prompt_tokens": sum(map(len, work.prompts)),
                "new_tokens": sum(work.new),
                **r.summary(),
                "additive_bound": bound,
                "of_bound": round(bound["seconds"] / r.seconds, 4),
                "gemm_floor_s": round(floor_s, 3),
                "of_gemm_floor": round(floor_s / r.seconds, 4),
                "device_busy": device_busy(r),
                "step_kinds": step_kinds(r.steps, b.limits),
                "decode_by_rows": decode_by_rows(r.steps, b.limits),
            }
        )
        rows.append(
            [
                f"mixed, seed {seed}" + (f", budget {budget}" if len(a.budgets) > 1 else ""),
                "-",
                r.summary()["tok_s"],
                f"{bound['seconds'] / r.seconds:.1%} of additive bound, "
                f"{floor_s / r.seconds:.1%} of GEMM floor, "
                f"ITL p50 / p99 {r.summary()['itl_p50_ms']} / {r.summary()['itl_p99_ms']} ms",
            ]
        )
    seed = a.seeds[0]
    if a.profile:
        first, count = (int(x) for x in a.profile.split(":"))
        r = b.timed("mixed_profiled", mixed(a.requests, b.vocab, 4096, seed), b.cache_blocks, True, 0,
                    (first, count))
        report["mixed_profile"] = {"seed": seed, **(r.profile or {})}
    if a.host_profile:
        r = b.timed("mixed_host_profiled", mixed(a.requests, b.vocab, 4096, seed), b.cache_blocks, True, 0,
                    host_profile=True)
        report["mixed_host_profile"] = {"seed": seed, **(r.host_profile or {})}


def prefix_runs(b: Bench, report: dict, rows: list[list[object]]) -> None:
    """`prefix`: shared system prompts in a cache that evicts, prefix caching on vs off."""
    a = b.a
    work = shared_prefixes(a.prefixes, a.per_prefix, a.prefix_len, b.vocab, 128, seed=7)
    running = min(MAX_NUM_SEQS, len(work.prompts)) * (64 + 128)
    blocks = -(-int(a.prefix_cache_share * a.prefixes * a.prefix_len + running) // BLOCK)
    blocks = max(blocks, -(-(a.prefix_len + 64 + 128) // BLOCK) * 2)
    on, off = (b.timed(f"prefix_{m}", work, blocks, m == "on", 0) for m in ("on", "off"))
    report["prefix"] = {
        "prefixes": a.prefixes,
        "per_prefix": a.per_prefix,
        "prefix_len": a.prefix_len,
        "question": 64,
        "new": 128,
        "cache_blocks": blocks,
        "on": on.summary(),
        "off": off.summary(),
        "throughput_ratio": round(off.seconds / on.seconds, 3),
        "ttft_p50_ratio": round(on.summary()["ttft_p50_ms"] / off.summary()["ttft_p50_ms"], 4),
        "same_tokens": sum(x == y for x, y in zip(on.outputs, off.outputs, strict=True)),
    }
    rows.append(
        [
            "shared prefix, evicting",
            "on / off",
            f"{on.summary()['tok_s']} / {off.summary()['tok_s']}",
            f"{off.seconds / on.seconds:.2f}x, TTFT p50 {report['prefix']['ttft_p50_ratio']:.1%}",
        ]
    )


def oversubscribed_runs(b: Bench, report: dict, rows: list[list[object]]) -> None:
    """`oversubscribed`: preempted requests' K/V offloaded to the host pool vs recomputed."""
    a = b.a
    report["oversubscribed"] = []
    for spec in a.oversub.split(","):
        count, prompt, new, ratio = oversubscribed_shape(spec)
        work = fixed(count, prompt, new, b.vocab, seed=11)
        blocks = -(-int(work.live_tokens / ratio) // BLOCK)
        host = b.config.kv_offload_blocks
        off_, rec = (
            b.timed(f"oversub_{spec}_{m}", work, blocks, True, host if m == "offload" else 0)
            for m in ("offload", "recompute")
        )
        # what offloading can save at most: the recompute run's extra prompt tokens, at the
        # GEMM rate (a lower bound on their cost, so the bound on the ratio is a little low)
        recomputed = sum(s["prompt"] for s in rec.steps) - sum(s["prompt"] for s in off_.steps)
        recompute_s = b.limits.prompt_gemm_s(max(0, recomputed))
        bound = rec.seconds / max(1e-9, rec.seconds - recompute_s)
        report["oversubscribed"].append(
            {
                "requests": count,
                "prompt": prompt,
                "new": new,
                "oversubscribed": ratio,
                "live_tokens": work.live_tokens,
                "cache_tokens": blocks * BLOCK,
                "host_pool_GiB": a.offload_gib,
                "offload": off_.summary(),
                "recompute": rec.summary(),
                "throughput_ratio": round(rec.seconds / off_.seconds, 3),
                "recomputed_tokens": recomputed,
                "recompute_gemm_s": round(recompute_s, 4),
                "ratio_bound": round(bound, 3),
                "same_tokens": sum(x == y for x, y in zip(off_.outputs, rec.outputs, strict=True)),
            }
        )
        rows.append(
            [
                f"oversubscribed {ratio:g}x: {count} x {prompt} + {new}",
                "offload / recompute",
                f"{off_.summary()['tok_s']} / {rec.summary()['tok_s']}",
                f"{rec.seconds / off_.seconds:.2f}x (bound {bound:.2f}x)",
            ]
        )


def long_run(b: Bench, report: dict, rows: list[list[object]]) -> None:
    """`long`: few requests, very long generations, against the decode roofline and the GEMM floor."""
    a = b.a
    work = fixed(a.long_requests, a.long_prompt, a.long_new, b.vocab, seed=13)
    r = b.timed("long", work, b.cache_blocks, True, 0)
    roof = sum(map(b.limits.decode_memory_s, r.steps))
    floor_s = gemm_floor(r.steps, b.floor)
    report["long"] = {
        "requests": a.long_requests,
        "prompt": a.long_prompt,
        "new": a.long_new,
        **r.summary(),
        "roofline_s": round(roof, 3),
        "of_roofline": round(roof / r.seconds, 4),
        "gemm_floor_s": round(floor_s, 3),
        "of_gemm_floor": round(floor_s / r.seconds, 4),
        "step_kinds": step_kinds(r.steps, b.limits),
    }
    rows.append(
        [
            f"long, {a.long_requests} x {a.long_prompt} + {a.long_new}",
            "-",
            r.summary()["tok_s"],
            f"{roof / r.seconds:.1%} of roofline, {floor_s / r.seconds:.1%} of GEMM floor",
        ]
    )


WORKLOADS = {  # in the order they run
    "mixed": mixed_runs, "prefix": prefix_runs, "oversubscribed": oversubscribed_runs, "long": long_run,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    unknown = [w for w in a.workloads if w not in WORKLOADS]
    if unknown:
        sys.exit(f"tandem bench workloads: unknown --workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    if a.model:
        return model_schedules(a, argv)
    if not a.smoke:
        need_cuda("workloads", "; --smoke runs the tiny shape on the CPU, --model the schedules on any host")
    device = "cpu" if a.smoke else "cuda"
    result_file = ResultFile("workloads", argv, device, a.shape, a.out,
                             tempfile.gettempdir() if a.smoke else None)
    b, report = build_bench(a)
    # warm-up: a short mixed pass (allocator, kernels of every step kind), not reported
    b.timed("warmup", mixed(min(64, a.requests), b.vocab, 4096, seed=999), b.cache_blocks, True, 0)
    freeze_start_up_heap()  # as the server's engine process serves (gc_pauses.py)
    rows: list[list[object]] = []
    for name, workload in WORKLOADS.items():
        if name in a.workloads:
            workload(b, report, rows)
            result_file.write(report)  # so far: a run cut short keeps what it measured
    print(markdown_table(["workload", "runs", "tokens/s", "against"], rows))
    print(f"wrote {result_file.write(report)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
