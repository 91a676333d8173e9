"""`tandem bench gpu`: GPU throughput of Tandem's step loop vs transformers' `generate_batch`, with
the roofline and the GEMM floor.

Random-initialised Llama-3.1-8B shape (or 1B) in bf16 on one CUDA device, as ../shared/bench/hf_cb_anchor.py:
32 requests x 128-token random prompts x 256 new tokens, greedy, fixed length (Tandem: ignore_eos;
transformers: eos disabled). Both run in the same process on the same model, each warmed up once first.
Device copy bandwidth is measured in the same run; the decode roofline is, per step,
(all weight bytes + K/V bytes of every sequence's context) / bandwidth, summed over the decode steps.

    tandem bench gpu [--shape 8b|1b] [--requests 32] [--prompt 128] [--new 256] [--skip-hf]
                     [--hf-config '{"use_cuda_graph": true}'] [--out PATH]
    tandem bench gpu --engines compiled --quantization none,fp8 --kv-cache-dtype auto,fp8 --skip-hf
                     # bf16 beside FP8 KV, FP8 weights and both, in one run: the ratios per engine
    tandem bench gpu --smoke    # tiny shape on CPU: checks the logic, numbers meaningless

Imports only tandem.service.engine.* (no settings, no gRPC): runs on a host with just torch + transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from tandem.bench.common import markdown_table, need_cuda
from tandem.bench.engine.gemm_floor import workload_floor
from tandem.bench.engine.harness import (
    RunStats,
    blocks_for,
    copy_bandwidth,
    environment,
    measure,
    need_generate_batch,
    release_hf,
    run_hf,
    run_tandem,
    same_outputs,
)
from tandem.bench.engine.precision import Precision, add_options, model_bytes, precisions
from tandem.bench.engine.variants import VARIANTS, build_model
from tandem.bench.record import ResultFile
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.ops.kv_cache import CacheShape

MUST_NOT_IMPORT = ("pydantic_settings", "grpc", "tandem.service.settings", "tandem.service.engine.factory")


class GpuBusy:
    """Mean NVML 'utilization.gpu' while the block runs (None without pynvml or a GPU)."""

    def __init__(self, device: torch.device, period: float = 0.05) -> None:
        self.mean: float | None = None
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            except Exception:  # no pynvml / no NVML: just don't sample
                self._handle = None
        self._period = period

    def _run(self) -> None:
        while not self._stop.is_set():
            self._samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            time.sleep(self._period)

    def __enter__(self) -> GpuBusy:
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._stop.set()
            self._thread.join()
            self.mean = round(sum(self._samples) / max(1, len(self._samples)) / 100, 3)


def with_gpu_busy(run: Callable[[], RunStats], device: torch.device) -> Callable[[], RunStats]:
    def wrapped() -> RunStats:
        with GpuBusy(device) as busy:
            stats = run()
        stats.gpu_busy = busy.mean
        return stats

    return wrapped


def roofline(weight_bytes: int, kv_per_token: int, bandwidth: float, requests: int, prompt: int, new: int
             ) -> dict:
    """Decode-only roofline: step j (j = 1..new-1) reads every weight once and, per sequence, the K/V of
    its prompt + j tokens. Prefill (compute-bound) is left out, so the measured time, which includes
    it, gives a conservative fraction: slightly with 32 prompts (one step), markedly with 256 (eight
    steps of 4,096 tokens). The median step against the mean roofline step is the steady decode's."""
    steps = [(weight_bytes + requests * (prompt + j) * kv_per_token) / bandwidth for j in range(1, new)]
    seconds = sum(steps)
    return {
        "weight_GB": round(weight_bytes / 1e9, 3),
        "kv_KiB_per_token": kv_per_token / 1024,
        "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
        "decode_steps": len(steps),
        "step_ms_first": round(1e3 * steps[0], 3) if steps else None,
        "step_ms_last": round(1e3 * steps[-1], 3) if steps else None,
        "step_ms_mean": round(1e3 * seconds / len(steps), 3) if steps else None,
        "seconds": round(seconds, 4),
        "tok_s": round(requests * max(1, new - 1) / seconds, 1) if seconds else None,
    }


def graph_vram(model: torch.nn.Module, spec: EngineConfig) -> dict:
    """Device memory the decode graphs take, captured for one slot and for two (one shared pool)."""
    from tandem.service.engine.cuda_graphs import DecodeGraphs

    report = {}
    for slots in (1, 2):
        core = build_core(model, dataclasses.replace(spec, cuda_graphs=False))
        runner = core.runner
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        graphs = DecodeGraphs(runner.decode_forward, runner.cache, runner.slots[:slots], runner.rotary)
        graphs.capture()
        report[f"{slots}_slot" + ("s" if slots > 1 else "")] = {
            "graphs": len(graphs.graphs),
            "MiB": round((torch.cuda.memory_reserved() - before) / 2**20, 1),
        }
        del graphs, runner, core
        torch.cuda.empty_cache()
    return report


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["8b", "1b"], default="8b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (random ids)")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request")
    ap.add_argument("--skip-hf", action="store_true", help="Tandem only")
    ap.add_argument("--engines", default="sync,async,eager,compiled",
                    help=f"Tandem variants, comma-separated (CUDA): {', '.join(VARIANTS)}")
    add_options(ap, lists=True)
    ap.add_argument("--vram", action="store_true", help="also report decode-graph memory, one slot vs two")
    ap.add_argument("--timeline", default=None, metavar="TRACE.json",
                    help="also record every step's stages (prepare, h2d, compute, d2h) of each Tandem engine "
                         "as a Chrome/Perfetto trace; `tandem bench timeline` draws it")
    ap.add_argument("--trace-overhead", action="store_true",
                    help="also time the last Tandem engine with step tracing off / 1%% / 100%% (needs "
                         "opentelemetry-sdk)")
    ap.add_argument("--hf-config", default='{"use_cuda_graph": true}',
                    help="ContinuousBatchingConfig kwargs (JSON); on failure, retried with defaults")
    ap.add_argument("--hf-persistent", action="store_true",
                    help="keep transformers' manager (cache, CUDA graphs) from the warm-up: setup not timed")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds after the warm-ups; best kept")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_<gpu>_gpu_<shape>-<requests>x<new>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, few tokens, CPU: checks the logic")
    a = ap.parse_args(argv)
    unknown = [name for name in a.engines.split(",") if name not in VARIANTS]
    if unknown:
        ap.error(f"unknown --engines {unknown}: choose from {', '.join(VARIANTS)}")
    a.device, a.dtype, a.copy_bytes = torch.device("cuda"), torch.bfloat16, 2 * 1024**3
    a.hf_base = {}  # what a failing --hf-config falls back to
    if a.smoke:
        a.shape, a.device, a.dtype = "tiny", torch.device("cpu"), torch.float32
        a.requests, a.prompt, a.new = min(a.requests, 4), min(a.prompt, 16), min(a.new, 8)
        a.copy_bytes = 64 * 1024**2
        # on CPU, transformers must be given a small cache: sized from RAM it zero-fills for seconds
        a.hf_base = {"num_blocks": 16, "block_size": 32, "max_batch_tokens": 256}
    a.hf_config = {**a.hf_base, **json.loads(a.hf_config)}
    return a


def check_needs(a: argparse.Namespace) -> None:
    if not a.smoke:
        need_cuda("gpu", "; --smoke runs the tiny shape on the CPU")
    if not a.skip_hf:
        need_generate_batch("gpu", "; --skip-hf runs Tandem alone")


def tandem_runs(a: argparse.Namespace, model: torch.nn.Module, prompts: list[list[int]], spec: EngineConfig
                ) -> tuple[dict[str, Callable[[], RunStats]], dict, dict]:
    """Each chosen variant's engine at each precision, built over `spec`: (its timed run by label,
    cores and configs by variant, e.g. "compiled+fp8")."""
    chosen = a.engines.split(",") if a.device.type == "cuda" else ["sync"]
    runs, cores, configs = {}, {}, {}
    for name, precision in [(n, p) for n in chosen for p in precisions(a)]:
        key, start = name + precision.suffix, time.perf_counter()
        # fusing and quantizing change a model in place: such a variant gets a twin of its own (same
        # seed, same weights)
        changes = VARIANTS[name].get("fuse_projections") or precision.quantization != "none"
        own = build_model(a.shape, a.device, a.dtype) if changes else model
        configs[key] = dataclasses.replace(spec, **VARIANTS[name], **precision.engine())
        cores[key] = build_core(own, configs[key])
        print(f"engine {key}: built (capture, compile) in {time.perf_counter() - start:.1f} s", flush=True)
        runs[label(key)] = with_gpu_busy(
            lambda core=cores[key], tag=key[:2] + precision.suffix: run_tandem(core, prompts, a.new, tag=tag),
            a.device,
        )
    return runs, cores, configs


def label(variant: str) -> str:
    """A run's name: "tandem" (sync) or "tandem_<variant>", then its precision ("+fp8+kv-fp8")."""
    name, plus, precision = variant.partition("+")
    return ("tandem" if name == "sync" else f"tandem_{name}") + plus + precision


def precision_ratios(a: argparse.Namespace, results: dict[str, RunStats]) -> dict:
    """Each engine's runs at the other precisions over its run at the first (the baseline), from this
    run's timings: tokens/s (above 1 = faster) and the median step (below 1 = shorter)."""
    first, *others = precisions(a)
    ratios = {}
    for name in (a.engines.split(",") if a.device.type == "cuda" else ["sync"]):
        base = results[label(name + first.suffix)]
        for precision in others:
            r = results[label(name + precision.suffix)]
            ratios[label(name + precision.suffix)] = {
                "over": label(name + first.suffix),
                "tok_s": round(r.tok_s / base.tok_s, 3),
                "median_step": round(r.step_ms["median"] / base.step_ms["median"], 3)
                if r.step_ms and base.step_ms else None,
            }
    return ratios


def other_precisions(a: argparse.Namespace, cores: dict, configs: dict
                     ) -> Iterator[tuple[str, torch.nn.Module, int]]:
    """Each run at a precision other than the model's own: its label, its engine's model as built
    (FP8 where quantized, with their scales) and its K/V bytes per token."""
    for key, config in configs.items():
        precision = Precision(config.quantization or "none", config.kv_cache_dtype)
        if precision != Precision():
            model = cores[key].runner.model
            yield label(key), model, precision.kv_bytes_per_token(model.config, a.dtype)


def precision_rooflines(a: argparse.Namespace, cores: dict, configs: dict, bandwidth: float) -> dict:
    """The decode roofline of each run at a precision other than the model's own, by label."""
    return {name: roofline(model_bytes(model), kv, bandwidth, a.requests, a.prompt, a.new)
            for name, model, kv in other_precisions(a, cores, configs)}


def precision_floors(a: argparse.Namespace, cores: dict, configs: dict, bandwidth: float) -> dict:
    """The GEMM floor of each run at a precision other than the model's own, by label (its FP8
    linears timed through the FP8 GEMM: gemm_floor.py)."""
    floors = {name: workload_floor(model, kv, bandwidth, a.requests, a.prompt, a.new, a.max_num_seqs,
                                   a.max_num_batched_tokens)
              for name, model, kv in other_precisions(a, cores, configs)}
    return {name: floor for name, floor in floors.items() if floor is not None}


def hf_run(a: argparse.Namespace, hf_model: torch.nn.Module, prompts: list[list[int]]
           ) -> Callable[[], RunStats]:
    """transformers' timed run; a failing --hf-config (e.g. CUDA graphs unsupported here) falls back
    to the base config once, and `a.hf_config` says which ran."""

    def run() -> RunStats:
        try:
            return run_hf(hf_model, prompts, a.new, a.hf_config, persistent=a.hf_persistent)
        except Exception as exc:
            if a.hf_config == a.hf_base:
                raise
            print(f"generate_batch with {a.hf_config} failed ({type(exc).__name__}: {exc}); retrying with "
                  f"{a.hf_base or 'the defaults'}", flush=True)
            a.hf_config = a.hf_base
            release_hf(hf_model)
            return run_hf(hf_model, prompts, a.new, a.hf_config, persistent=a.hf_persistent)

    return with_gpu_busy(run, a.device)


def step_telemetry(a: argparse.Namespace, cores: dict, prompts: list[list[int]]) -> dict:
    """--trace-overhead and --timeline: what tracing costs the last engine; every engine's steps."""
    extra: dict = {}
    last = list(cores)[-1]
    if a.trace_overhead:
        from tandem.bench.engine.step_telemetry import tracing_overhead_runs

        traced = measure(tracing_overhead_runs(cores[last], prompts, a.new), max(a.repeat, 2))
        off = traced["tracing_off"].tok_s
        extra["tracing_overhead"] = {
            "engine": last,
            **{name: {"tok_s": round(r.tok_s, 1), "overhead": round(1 - r.tok_s / off, 4)}
               for name, r in traced.items()},
        }
        print(f"tracing overhead ({last}): {extra['tracing_overhead']}", flush=True)
    if a.timeline:
        from tandem.bench.engine.step_telemetry import record_timeline

        extra["timeline"] = record_timeline(
            {(n if n != "sync" else "tandem_sync"): c for n, c in cores.items()}, prompts, min(a.new, 64),
            Path(a.timeline),
        )
        print(f"timeline of {extra['timeline']} steps written to {a.timeline}", flush=True)
    return extra


def compare(a: argparse.Namespace, results: dict[str, RunStats], base_roof: dict, base_floor: dict | None,
            roofs: dict | None = None, floors: dict | None = None) -> tuple[dict, list[list[object]]]:
    """Each run's share of its roofline and of its GEMM floor (`roofs`' and `floors`' where its
    precision has its own, else the model's): (report by run, table rows)."""
    rows, report = [], {}
    for name, r in results.items():
        roof = (roofs or {}).get(name, base_roof)
        floor = (floors or {}).get(name, base_floor)
        fraction = roof["seconds"] / r.seconds
        report[name] = {**r.summary(), "fraction_of_roofline": round(fraction, 4)}
        if roof is not base_roof:
            report[name]["roofline"] = roof
        if floor is not None:
            report[name]["fraction_of_gemm_floor"] = round(floor["seconds"] / r.seconds, 4)
            if floor is not base_floor:
                report[name]["gemm_floor"] = floor
        median = r.step_ms["median"] if r.step_ms else None  # transformers has no steps of ours
        step_fraction = roof["step_ms_mean"] / median if median and roof["step_ms_mean"] else None
        if step_fraction is not None:
            report[name]["median_step_of_roofline_step"] = round(step_fraction, 4)
        rows.append([name, r.tokens, round(r.seconds, 2), round(r.tok_s, 1),
                     round(1e3 * r.seconds / r.steps, 2) if r.steps else "-", f"{fraction:.1%}",
                     f"{step_fraction:.1%}" if step_fraction is not None else "-",
                     f"{floor['seconds'] / r.seconds:.1%}" if floor is not None else "-",
                     f"{r.gpu_busy:.0%}" if r.gpu_busy is not None else "-",
                     f"{r.engine_idle:.1%}" if r.engine_idle is not None else "-", r.warmup_seconds])
    roof, floor = base_roof, base_floor
    rows.append(["roofline (decode)", a.requests * max(1, a.new - 1), roof["seconds"], roof["tok_s"],
                 f"{roof['step_ms_first']}-{roof['step_ms_last']}", "100%", "100%", "-", "-", "-", "-"])
    if floor is not None:
        rows.append(["GEMM floor (GEMMs + K/V reads only)", a.requests * max(1, a.new - 1), floor["seconds"],
                     floor["tok_s"], floor["decode_gemm_ms_per_step"], f"{floor['of_roofline']:.1%}", "-",
                     "100%", "-", "-", "-"])
    if "transformers" in results:
        report["transformers"]["continuous_batching_config"] = a.hf_config
        report["transformers"]["attn_implementation"] = "paged|sdpa"
        report["transformers"]["persistent_manager"] = a.hf_persistent
        # against the engines at the model's own precision: transformers runs it in that one
        own = [r for n, r in results.items() if n != "transformers" and n not in (roofs or {})]
        best = max(own, key=lambda r: r.tok_s)
        report["ratio_tandem_over_transformers"] = round(best.tok_s / results["transformers"].tok_s, 3)
        same = same_outputs(best, results["transformers"])
        report["identical_outputs"] = f"{same}/{a.requests}"
    return report, rows


def print_stalls(results: dict[str, RunStats]) -> None:
    """What could have held up each timed run's slowest step (harness.StallWatch)."""
    for name, r in results.items():
        for i, timed in enumerate(r.all_runs):
            if "step_ms_max" in timed:
                print(f"{name}, timed run {i + 1}: slowest step {timed['step_ms_max']} ms; full garbage "
                      f"collections {timed['gc_full_collections']} ({timed['gc_full_s']} s), frames "
                      f"compiled {timed['frames_compiled']}, kernel variants compiled "
                      f"{timed['kernel_variants_compiled']}")
                for seen in timed["slow_step_stacks"][:2]:  # where the steps past 100 ms were, sampled
                    print(f"  {seen['seconds']} s in {seen['stack']}")


def build_models(a: argparse.Namespace, bandwidth: float
                 ) -> tuple[torch.nn.Module, torch.nn.Module | None, dict]:
    """The model the engines run and transformers' twin (same seed, same weights: building a Tandem
    engine fuses its model's projections in place, which must not change the baseline); their facts."""
    start = time.perf_counter()
    model = build_model(a.shape, a.device, a.dtype)
    hf_model = None if a.skip_hf else build_model(a.shape, a.device, a.dtype)
    facts = {"build_s": time.perf_counter() - start,
             "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
             "kv_per_token": CacheShape.of(model.config).bytes_per_token(a.dtype)}
    print(f"model {a.shape} built in {facts['build_s']:.1f} s: {facts['weight_bytes'] / 1e9:.2f} GB of "
          f"weights; copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    return model, hf_model, facts


def bounds(a: argparse.Namespace, model: torch.nn.Module, facts: dict, bandwidth: float
           ) -> tuple[dict, dict | None]:
    """The decode roofline, and the GEMM floor of the model the first engine runs (fused where it fuses)."""
    roof = roofline(facts["weight_bytes"], facts["kv_per_token"], bandwidth, a.requests, a.prompt, a.new)
    floor = workload_floor(model, facts["kv_per_token"], bandwidth, a.requests, a.prompt, a.new,
                           a.max_num_seqs, a.max_num_batched_tokens)
    if floor is not None:
        floor["of_roofline"] = round(roof["seconds"] / floor["seconds"], 4)
    return roof, floor


def print_summary(rows: list[list[object]], report: dict, vram: dict | None, max_num_seqs: int,
                  results: dict[str, RunStats], leaked: list[str]) -> None:
    print(markdown_table(["engine", "tokens", "seconds", "tokens/s", "ms/step", "of roofline",
                          "median step of roofline step", "of GEMM floor", "GPU busy", "engine idle",
                          "warm-up s"], rows))
    if "ratio_tandem_over_transformers" in report:
        print(f"\nTandem / transformers = {report['ratio_tandem_over_transformers']:.2f}x; identical greedy "
              f"outputs: {report['identical_outputs']} (bf16 on GPU: some drift between kernels is expected)")
    for name, ratio in report.get("precision_ratios", {}).items():
        print(f"{name} / {ratio['over']}: tokens/s {ratio['tok_s']:.3f}x, "
              f"median step {ratio['median_step']}x")
    if vram:
        print(f"decode graph memory (max batch {max_num_seqs}): {vram}")
    print_stalls(results)
    if leaked:
        print(f"WARNING: imported {leaked}: this would fail on a host without the server's dependencies")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    check_needs(a)
    result_file = ResultFile("gpu", argv, a.device, f"{a.shape}-{a.requests}x{a.new}", a.out,
                             tempfile.gettempdir() if a.smoke else None)
    env = environment(a.device)
    where = env.get("gpu", env["cpu"])
    print(f"torch {env['torch']}, transformers {env['transformers']}, {where}", flush=True)
    bandwidth = copy_bandwidth(a.device, a.copy_bytes)
    model, hf_model, facts = build_models(a, bandwidth)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size - 2, (a.requests, a.prompt), generator=g).tolist()
    spec = EngineConfig(blocks_for(a.requests, a.prompt + a.new, a.block_size), a.block_size, a.max_num_seqs,
                        a.max_num_batched_tokens, step_loop="sync")
    runs, cores, configs = tandem_runs(a, model, prompts, spec)
    vram = graph_vram(model, spec) if a.vram and a.device.type == "cuda" else None
    if hf_model is not None:
        runs["transformers"] = hf_run(a, hf_model, prompts)
    results = measure(runs, a.repeat)
    extra = step_telemetry(a, cores, prompts)
    if hf_model is not None:
        release_hf(hf_model)
    roof, floor = bounds(a, next(iter(cores.values())).runner.model, facts, bandwidth)
    report, rows = compare(a, results, roof, floor, precision_rooflines(a, cores, configs, bandwidth),
                           precision_floors(a, cores, configs, bandwidth))
    if len(precisions(a)) > 1:
        report["precision_ratios"] = precision_ratios(a, results)
    for name, config in configs.items():  # each engine's own settings (the variant over the benchmark's spec)
        report[label(name)]["engine"] = config.__dict__
    # through `tandem bench`, the CLI itself has imported the server's settings: nothing to check
    leaked = [m for m in MUST_NOT_IMPORT if m in sys.modules] if "tandem.cli" not in sys.modules else []
    out = result_file.write({
        "benchmark": "gpu_sync",
        "smoke": a.smoke,
        "model": f"random-init Llama {a.shape} shape, {a.dtype}",
        "workload": {"requests": a.requests, "prompt_tokens": a.prompt, "new_tokens": a.new,
                     "prompts": "random token ids", "sampling": "greedy, fixed length",
                     "precisions": [vars(p) for p in precisions(a)]},
        "environment": env,
        "model_build_seconds": round(facts["build_s"], 1),
        "roofline": roof,
        "gemm_floor": floor,
        "decode_graph_vram": vram,
        **extra,
        **report,
        "imported_server_only_modules": leaked,
    })
    print_summary(rows, report, vram, spec.max_num_seqs, results, leaked)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
