"""The engine on real-shaped workloads, each side by side with the feature it needs turned off, in one run.

    tandem bench workloads [--shape 8b] [--workloads mixed,prefix,oversubscribed,long] [--seeds 1,2,3]
    tandem bench workloads --smoke      # tiny shape on CPU: checks the logic, numbers meaningless
    tandem bench workloads --model --budgets 1024,2048,4096   # any host: exact schedules, modelled steps

One engine core at the server's CUDA settings (compiled decode and prefill forwards, CUDA graphs,
fused projections, cuBLASLt, rotary in the decode kernel, the asynchronous loop, the server's step
budget and sequence cap) is built once; each run gets a fresh scheduler over the same device cache
(its own block count, prefix caching on or off, a host pool or none), so the runs differ in nothing
else. Every request runs to its max_tokens (ignore_eos), greedy, all submitted at once.

- `mixed`: a ShareGPT-like mix (serve_workload.py's log-normal lengths: prompts 16-2,048, mean
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
import cProfile
import dataclasses
import json
import pstats
import random
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import _repo  # noqa: F401  (must come before any tandem import)
import torch
from common import StallWatch, copy_bandwidth, environment, markdown_table, sync, write_json
from gemm_floor import StepGemmFloor, linear_shapes
from gemm_floor import timed as seconds_per_call
from gpu_sync import SERVER_CUDA, build_model
from serve_stats import percentile
from serve_workload import jobs as make_jobs
from shapes import SHAPES
from slow_steps import STEPS
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core, build_scheduler
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.gc_pauses import freeze_start_up_heap
from tandem.service.engine.ops.kv_cache import CacheShape
from tandem.service.engine.sampling_params import GenerationRequest, SamplingParams
from tandem.service.engine.timing import StepTiming

BLOCK = 16
# KV offload's block counts as a run records them, each from the scheduler's blocks_<name>
OFFLOAD_BLOCKS = {"out": "offloaded", "in": "restored", "reused": "reused", "kept": "kept"}
MAX_NUM_SEQS, BUDGET = 256, 2048  # the server's defaults


@dataclass
class Workload:
    prompts: list[list[int]]
    new: list[int]

    @property
    def live_tokens(self) -> int:
        return sum(len(p) + n for p, n in zip(self.prompts, self.new, strict=True))


@dataclass
class Run:
    """One timed pass of a workload through the core."""

    seconds: float
    tokens: int
    outputs: list[list[int]]
    ttft: list[float]
    steps: list[dict] = field(default_factory=list)  # per step: kind, decode contexts, prompt tokens, times
    preempted: tuple[int, int] = (0, 0)  # (offload, recompute)
    hit_tokens: int = 0
    queried_tokens: int = 0
    profile: dict | None = None
    host_profile: dict | None = None
    allocator: dict = field(default_factory=dict)  # CUDA caching allocator counters during the run
    itl: list[float] = field(default_factory=list)  # every gap between a request's tokens
    tpot: list[float] = field(default_factory=list)  # per request: (last token - first) / (tokens - 1)
    stalls: dict = field(default_factory=dict)  # collections and compiles during the run (StallWatch)
    # copied out, copied back, found still cached, left on the device uncopied (OFFLOAD_BLOCKS)
    offload_blocks: tuple[int, ...] = (0, 0, 0, 0)

    def summary(self) -> dict:
        return {
            "seconds": round(self.seconds, 3),
            "tok_s": round(self.tokens / self.seconds, 1),
            "steps": len(self.steps),
            **{
                f"{name}_{p}_ms": percentile_ms(values, q)
                for name, values in (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl))
                for p, q in (("p50", 0.5), ("p99", 0.99))
            },
            "preemptions_offload": self.preempted[0],
            "preemptions_recompute": self.preempted[1],
            "prefix_hit_rate": round(self.hit_tokens / self.queried_tokens, 4)
            if self.queried_tokens
            else 0.0,
            **({"allocator": self.allocator} if self.allocator else {}),
            **({"stalls": self.stalls} if self.stalls else {}),
            **(
                {"kv_offload_blocks": dict(zip(OFFLOAD_BLOCKS, self.offload_blocks, strict=True))}
                if any(self.offload_blocks)
                else {}
            ),
        }


def fresh_scheduler(
    core: EngineCore, config: EngineConfig, num_blocks: int, prefix_caching: bool, host_blocks: int,
    budget: int = BUDGET,
) -> None:
    """A new scheduler over the core's cache (built from `config`): its own block count (at most
    the cache's), prefix caching on or off, a host pool (within the runner's) or none, its own token
    budget per step (at most the one the core's step buffers were sized for)."""
    assert num_blocks <= core.runner.cache.num_blocks and budget <= config.max_num_batched_tokens
    pool = core.runner.offload
    assert host_blocks == 0 or (pool is not None and host_blocks <= pool.store.shape[0])
    mine = dataclasses.replace(
        config, num_blocks=num_blocks, prefix_caching=prefix_caching, kv_offload_blocks=host_blocks,
        max_num_batched_tokens=budget,
    )
    core.scheduler = build_scheduler(mine, core.runner.model)


# cudaMalloc retries free the cache and synchronise the device; device allocs and frees are calls
# the driver serialises: a run in steady state should have none of either
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counters(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def run(
    core: EngineCore,
    work: Workload,
    tag: str,
    profile: tuple[int, int] | None = None,
    host_profile: bool = False,
) -> Run:
    """Every request at once; each step's kind and sizes recorded from the scheduler's output, and
    the host time of its launch (queueing its forward). `profile` (first step, steps): kernels of
    those steps by kind, from torch.profiler (Run.profile). `host_profile`: the Python functions
    that the launches of mixed steps spend their time in, from cProfile (Run.host_profile)."""
    scheduler = core.scheduler
    steps: list[dict] = []
    schedule = scheduler.schedule
    launch = core.runner.launch
    launch_ms: list[float] = []
    launches = cProfile.Profile() if host_profile else None
    host_steps = 0

    def timed_launch(*args, **kwargs):
        nonlocal host_steps
        profiled = launches is not None and steps[-1]["kind"] == "mixed"  # scheduled just before
        t = time.perf_counter()
        if profiled:
            launches.enable()
            host_steps += 1
        try:
            return launch(*args, **kwargs)
        finally:
            if profiled:
                launches.disable()
            launch_ms.append(1e3 * (time.perf_counter() - t))

    def recording():
        out = schedule()
        if out.chunks:
            decode = [c.start + 1 for c in out.chunks if c.num_tokens == 1]
            prompt = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1)
            kind = "mixed" if decode and prompt else ("decode" if decode else "prompt")
            steps.append(
                {"kind": kind, "decode_context": sum(decode), "decode_rows": len(decode), "prompt": prompt}
            )
        return out

    timings: list[StepTiming] = []
    scheduler.schedule = recording
    core.runner.launch = timed_launch
    profiler, profiled = None, None  # the profiler while it runs; (first, last) steps it saw
    core.step_observer = timings.append
    ids = [f"{tag}{i}" for i in range(len(work.prompts))]
    outputs: dict[str, list[int]] = {r: [] for r in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    sync(core.runner.device)
    counted = allocator_counters(core.runner.device)
    syncs = SyncCalls() if host_profile and core.runner.device.type == "cuda" else None
    start = time.perf_counter()
    for rid, prompt, n in zip(ids, work.prompts, work.new, strict=True):
        core.add(
            GenerationRequest(
                rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            )
        )
    while core.has_work:
        if profile is not None and profiled is None:
            if profiler is None and len(steps) >= profile[0]:
                sync(core.runner.device)
                cuda = core.runner.device.type == "cuda"
                kind = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
                profiler = torch.profiler.profile(activities=[kind])
                profiler.__enter__()
                began = len(steps)
            elif profiler is not None and len(steps) >= began + profile[1]:
                sync(core.runner.device)
                profiler.__exit__(None, None, None)
                profiled = (began, len(steps))
        for u in STEPS.watched(core.run_once):
            if u.error:
                raise RuntimeError(f"{u.request_id}: {u.error}")
            now = time.perf_counter() - start
            if u.request_id not in first:
                first[u.request_id] = now
            else:
                itl.append(now - last[u.request_id])
            last[u.request_id] = now
            outputs[u.request_id].append(u.token)
    sync(core.runner.device)
    seconds = time.perf_counter() - start
    allocator = {k: v - counted[k] for k, v in allocator_counters(core.runner.device).items()}
    if syncs is not None:
        allocator["synchronising_calls"] = syncs.close()
    core.step_observer = None
    del scheduler.schedule
    del core.runner.launch
    for step, timing, host in zip(steps, timings, launch_ms, strict=True):  # every step, in order
        step["prepare_ms"] = 1e3 * (timing.prepare[1] - timing.prepare[0])
        step["launch_ms"] = host
        if timing.compute is not None:
            step["device_ms"] = 1e3 * (timing.compute[1] - timing.compute[0])
    got = [outputs[r] for r in ids]
    short = [i for i, (o, n) in enumerate(zip(got, work.new, strict=True)) if len(o) != n]
    if short:
        raise RuntimeError(f"{len(short)} requests ended early")
    blocks = scheduler.blocks
    kernels = kernel_profile(*profiled, profiler, steps) if profiled is not None else None
    hosted = host_functions(launches, host_steps) if launches is not None and host_steps else None
    return Run(
        seconds,
        sum(work.new),
        got,
        list(first.values()),
        steps,
        (scheduler.preempted_offload, scheduler.preempted_recompute),
        blocks.hit_tokens,
        blocks.queried_tokens,
        kernels,
        hosted,
        allocator,
        itl,
        [(last[r] - first[r]) / (len(outputs[r]) - 1) for r in ids if len(outputs[r]) > 1],
        offload_blocks=tuple(getattr(scheduler, f"blocks_{name}") for name in OFFLOAD_BLOCKS.values()),
    )


def percentile_ms(values: list[float], q: float) -> float | None:
    """The q-quantile of `values` (seconds) in ms, interpolated as every bench's (serve_stats);
    None when empty."""
    value = percentile(values, 100 * q)
    return None if value is None else round(1e3 * value, 1)


class SyncCalls:
    """Every operation that synchronises the host with the device while it is open, by the engine
    line that made it (torch.cuda.set_sync_debug_mode): a step loop that never waits but once per
    step has none. The explicit per-step wait (an event's synchronize) is not one of them."""

    def __init__(self) -> None:
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def close(self) -> dict[str, int]:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)
        where: dict[str, int] = defaultdict(int)
        for w in self._seen:
            where[f"{Path(w.filename).name}:{w.lineno}"] += 1
        return dict(sorted(where.items(), key=lambda kv: -kv[1]))


def host_functions(profiler: cProfile.Profile, steps: int, top: int = 30) -> dict:
    """The functions the profiled launches spent their own time in (cProfile's tottime), per step."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, _)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    named = [(f"{Path(f).name}:{line}({name})", calls, tottime)
             for (f, line, name), (calls, _, tottime, _, _) in rows]
    return {
        "steps": steps,
        "own_ms_per_step": {name: round(1e3 * tottime / steps, 3) for name, _, tottime in named},
        "calls_per_step": {name: round(calls / steps, 1) for name, calls, _ in named},
    }


def kernel_profile(first: int, last: int, profiler: torch.profiler.profile, steps: list[dict]) -> dict:
    """Device time by kernel kind per profiled step, beside what those steps were."""
    from profile_gpu import kernel_kind

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    n = max(1, last - first)
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kind[kernel_kind(e["name"])] += float(e["dur"]) / n
        by_name[e["name"][:100]] += float(e["dur"]) / n
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / n if kernels else 0.0
    of = steps[first:last]
    return {
        "steps": len(of),
        "kinds": {k: sum(s["kind"] == k for s in of) for k in ("decode", "prompt", "mixed")},
        "prompt_tokens_mean": round(sum(s["prompt"] for s in of) / max(1, len(of)), 1),
        "decode_rows_mean": round(sum(s["decode_rows"] for s in of) / max(1, len(of)), 1),
        "launch_ms_mean": round(sum(s.get("launch_ms", 0) for s in of) / max(1, len(of)), 3),
        "kernel_span_ms_per_step": round(span / 1e3, 3),
        "kernel_busy_ms_per_step": round(sum(by_kind.values()) / 1e3, 3),
        "kernels_per_step": round(len(kernels) / n, 1),
        "by_kind_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels_us": {k: round(v, 1) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:20]},
    }


# -- limits ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    weight_bytes: int
    linear_params: int  # GEMM weights a prompt token goes through (embedding and LM head apart)
    kv_per_token: int
    bandwidth: float  # bytes read + written per second, device-to-device copy
    gemm_flops: float  # dense GEMM rate, FLOP/s

    def decode_memory_s(self, step: dict) -> float:
        """A step's decode rows' memory traffic at the copy bandwidth: every weight, their K/V."""
        if not step["decode_rows"]:
            return 0.0
        return (self.weight_bytes + step["decode_context"] * self.kv_per_token) / self.bandwidth

    def prompt_gemm_s(self, tokens: int) -> float:
        """The GEMM work of `tokens` prompt tokens at the measured GEMM rate."""
        return 2 * self.linear_params * tokens / self.gemm_flops

    def step_bound_s(self, step: dict) -> float:
        """One step at the additive bound: its decode rows' memory traffic plus its prompt GEMMs."""
        return self.decode_memory_s(step) + self.prompt_gemm_s(step["prompt"])

    def bound_s(self, steps: list[dict]) -> float:
        """Steps at the additive bound, summed step by step."""
        return sum(map(self.step_bound_s, steps))

    def additive_bound(self, steps: list[dict]) -> dict:
        decode = sum(map(self.decode_memory_s, steps))
        prompt = sum(self.prompt_gemm_s(s["prompt"]) for s in steps)
        return {
            "decode_memory_s": round(decode, 3),
            "prompt_gemm_s": round(prompt, 3),
            "seconds": round(decode + prompt, 3),
        }


def modelled_device(shape: str, bandwidth: float, gemm_flops: float) -> Device:
    """The additive bound's constants of `shape` in bf16, from a model with no storage (for the
    schedule-only runs: `--model` here, `tandem bench offload-bound`)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
    return Device(
        weight_bytes=2 * sum(p.numel() for p in model.parameters()),
        linear_params=linear_params(model),
        kv_per_token=CacheShape.of(model.config).bytes_per_token(torch.bfloat16),
        bandwidth=bandwidth,
        gemm_flops=gemm_flops,
    )


def linear_params(model: torch.nn.Module) -> int:
    shapes, _head = linear_shapes(model)  # the GEMM weights as the engine runs them, LM head apart
    return sum(out_f * in_f * count for (out_f, in_f), count in shapes.items())


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """Dense GEMM FLOP/s of an n x n x n product (gemm_floor's timing: a CUDA graph of the calls)."""
    cuda = device.type == "cuda"
    if not cuda:
        n = 256
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, reps=10, cuda=cuda)


CACHE_GIB = 60.0  # what the H200 runs used: the mixed workload's 512 requests run without preemption
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


def gemm_floor(steps: list[dict], floor: StepGemmFloor) -> float:
    """Each step's GEMM floor (its linears at its rows, the LM head at its decode rows, the K/V read),
    kept in the step as `floor_ms`; -> the run's, in seconds."""
    for s in steps:
        rows = s["prompt"] + s["decode_rows"]
        s["floor_ms"] = 1e3 * floor.seconds(rows, max(1, s["decode_rows"]), s["decode_context"])
    return sum(s["floor_ms"] for s in steps) / 1e3


def device_busy(r: Run) -> float | None:
    """The share of the run's time the compute stream spent in steps (the rest: the host's)."""
    device = [s["device_ms"] for s in r.steps if "device_ms" in s]
    return round(sum(device) / 1e3 / r.seconds, 4) if device else None


DECODE_ROWS = ((1, 16), (17, 64), (65, 128), (129, 256))  # decode-only steps, by batch size


def step_kinds(steps: list[dict], limits: Device | None = None) -> dict:
    """Per kind of step: how many, their device time (and, with `limits`, their own additive
    bound and its share of that time; where the steps carry it, their GEMM floor and its share)
    and host times."""
    kinds = ("decode", "prompt", "mixed")
    return step_groups({kind: [s for s in steps if s["kind"] == kind] for kind in kinds}, limits)


def decode_by_rows(steps: list[dict], limits: Device | None = None) -> dict:
    """The decode-only steps of step_kinds, by batch size."""
    decode = [s for s in steps if s["kind"] == "decode"]
    return step_groups({f"{lo}-{hi} rows": [s for s in decode if lo <= s["decode_rows"] <= hi]
                        for lo, hi in DECODE_ROWS}, limits)


def step_groups(groups: dict[str, list[dict]], limits: Device | None) -> dict:
    out = {}
    for kind, of in groups.items():
        if not of:
            continue
        device = [s["device_ms"] for s in of if "device_ms" in s]
        bound = {}
        if limits is not None and device:
            seconds = limits.bound_s(of)
            bound = {"bound_s": round(seconds, 3), "of_bound": round(1e3 * seconds / sum(device), 4)}
        if device and all("floor_ms" in s for s in of):
            floor = sum(s["floor_ms"] for s in of)
            bound |= {"floor_s": round(floor / 1e3, 3), "of_floor": round(floor / sum(device), 4)}
        out[kind] = {
            "steps": len(of),
            "device_s": round(sum(device) / 1e3, 3) if device else None,
            **bound,
            "prepare_ms_mean": round(sum(s["prepare_ms"] for s in of) / len(of), 3),
            "launch_ms_mean": round(sum(s["launch_ms"] for s in of) / len(of), 3),
            "launch_ms_p50": round(percentile([s["launch_ms"] for s in of], 50), 3),
            "launch_ms_max": round(max(s["launch_ms"] for s in of), 3),
            "prompt_tokens_mean": round(sum(s["prompt"] for s in of) / len(of), 1),
            "decode_rows_mean": round(sum(s["decode_rows"] for s in of) / len(of), 1),
        }
    return out


# -- workloads -------------------------------------------------------------------------------------


def oversubscribed_shape(spec: str) -> tuple[int, int, int, float]:
    """`--oversub`'s REQUESTSxPROMPT+NEW@R -> requests, prompt tokens, new tokens, R (live context
    over what the cache holds)."""
    shape, ratio = spec.split("@")
    count, rest = shape.split("x")
    prompt, new = (int(x) for x in rest.split("+"))
    return int(count), prompt, new, float(ratio)


def mixed(count: int, vocab: int, max_len: int, seed: int) -> Workload:
    js = make_jobs("mixed", count, vocab, max_len, seed)
    return Workload([j.prompt_ids for j in js], [j.max_tokens for j in js])


def shared_prefixes(
    prefixes: int, per_prefix: int, prefix_len: int, vocab: int, new: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts = [s + [rng.randrange(vocab) for _ in range(64)] for s in systems for _ in range(per_prefix)]
    rng.shuffle(prompts)
    return Workload(prompts, [new] * len(prompts))


def fixed(count: int, prompt: int, new: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return Workload([[rng.randrange(vocab) for _ in range(prompt)] for _ in range(count)], [new] * count)


def schedule_model(shape: str, seeds: list[int], budgets: list[int], requests: int, cache_gib: float) -> dict:
    """The mixed workload's exact schedules (the engine's scheduler, the forward replaced by a token
    fill: `tandem bench host`'s) at each budget, each step at the additive bound of `shape` on the
    H200's measured rates: what a budget changes in steps, bound and the longest gap a decoding
    sequence sees, on any host, before a GPU run measures it."""
    from host_step import no_forward

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        f"free memory after the model and the rates' buffers is smaller ({CACHE_SHARE:.0%} of it)",
    )
    ap.add_argument("--out", default="bench/results/workloads.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, few tokens: checks the logic")
    ap.add_argument(
        "--model",
        action="store_true",
        help="mixed only, any host: each seed's exact schedule at each budget (the forward replaced), its "
        "steps at the additive bound of --shape on the H200's measured rates",
    )
    a = ap.parse_args()
    if a.model:
        report = schedule_model(a.shape, [int(x) for x in a.seeds.split(",")],
                                [int(b) for b in a.budgets.split(",")], a.requests, a.cache_gib or CACHE_GIB)
        print(markdown_table(
            ["seed", "budget", "steps", "mixed steps", "bound (s)", "longest step with decodes (ms)"],
            [[r["seed"], r["budget"], r["steps"], r["mixed_steps"], r["bound_s"], r["longest_decode_step_ms"]]
             for r in report["mixed_model"]]))
        print(f"wrote {write_json(a.out, report)}", file=sys.stderr)
        return
    if a.smoke:
        a.shape, a.requests, a.seeds = "tiny", 24, "1"
        a.prefixes, a.per_prefix, a.prefix_len = 3, 4, 64
        a.oversub = "12x48+24@2,6x16+64@3"
        a.long_requests, a.long_prompt, a.long_new = 2, 16, 64
        a.cache_gib, a.offload_gib = 0.05, 0.02
    budgets = [int(b) for b in a.budgets.split(",")]
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    model = build_model(a.shape, device, dtype)
    vocab = model.config.vocab_size
    shape = CacheShape.of(model.config)
    kv = shape.bytes_per_token(dtype)
    limits = Device(
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        linear_params=linear_params(model),
        kv_per_token=kv,
        bandwidth=copy_bandwidth(device) if device.type == "cuda" else 1e10,
        gemm_flops=gemm_rate(device, dtype),
    )
    if a.cache_gib is None:
        a.cache_gib = cache_gib_that_fits(device)
    cache_blocks = int(a.cache_gib * 2**30) // (kv * BLOCK)
    long_len = a.long_prompt + a.long_new
    max_len = max(4096, long_len + BLOCK)
    config = EngineConfig(
        num_blocks=cache_blocks,
        block_size=BLOCK,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=max(budgets),  # the step buffers hold the largest budget's steps
        max_model_len=max_len,
        prefix_caching=True,
        kv_offload_blocks=int(a.offload_gib * 2**30) // (kv * BLOCK),
        **({} if a.smoke else {**SERVER_CUDA, "step_loop": "async"}),
    )
    built = time.perf_counter()
    core = build_core(model, config)
    floor = StepGemmFloor(model, kv, limits.bandwidth)
    report: dict = {
        "environment": environment(device),
        "shape": a.shape,
        "engine": {
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": budgets[0],
            "mixed_budgets": budgets,
            "block_size": BLOCK,
            "cache_gib": a.cache_gib,
            "build_s": round(time.perf_counter() - built, 1),
            **({} if a.smoke else SERVER_CUDA),
        },
        "copy_bandwidth_TBps": round(limits.bandwidth / 1e12, 3),
        "gemm_TFLOPs": round(limits.gemm_flops / 1e12, 1),
        "weight_GB": round(limits.weight_bytes / 1e9, 3),
        "kv_KiB_per_token": kv / 1024,
    }
    rows: list[list[object]] = []
    selected = a.workloads.split(",")

    def timed(
        name: str,
        work: Workload,
        num_blocks: int,
        prefix: bool,
        host: int,
        profile: tuple[int, int] | None = None,
        host_profile: bool = False,
        budget: int | None = None,  # None: the first of --budgets, as every workload but mixed runs
    ) -> Run:
        budget = budget or budgets[0]
        fresh_scheduler(core, config, num_blocks, prefix, host, budget)
        with StallWatch() as stalls:
            result = run(core, work, name, profile, host_profile)
        result.stalls = stalls.seen
        print(f"{name}: {result.summary()}", file=sys.stderr, flush=True)
        return result

    # warm-up: a short mixed pass (allocator, kernels of every step kind), not reported
    timed("warmup", mixed(min(64, a.requests), vocab, 4096, seed=999), cache_blocks, True, 0)
    freeze_start_up_heap()  # as the server's engine process serves (gc_pauses.py)

    if "mixed" in selected:
        report["mixed"] = []
        for seed, budget in [(int(s), b) for s in a.seeds.split(",") for b in budgets]:
            work = mixed(a.requests, vocab, 4096, seed)
            r = timed(f"mixed{seed}_{budget}", work, cache_blocks, True, 0, budget=budget)
            bound = limits.additive_bound(r.steps)
            floor_s = gemm_floor(r.steps, floor)
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
                    "step_kinds": step_kinds(r.steps, limits),
                    "decode_by_rows": decode_by_rows(r.steps, limits),
                }
            )
            rows.append(
                [
                    f"mixed, seed {seed}" + (f", budget {budget}" if len(budgets) > 1 else ""),
                    "-",
                    r.summary()["tok_s"],
                    f"{bound['seconds'] / r.seconds:.1%} of additive bound, "
                    f"{floor_s / r.seconds:.1%} of GEMM floor, "
                    f"ITL p50 / p99 {r.summary()['itl_p50_ms']} / {r.summary()['itl_p99_ms']} ms",
                ]
            )
        if a.profile:  # a run of its own: the profiler slows the steps it records
            first, count = (int(x) for x in a.profile.split(":"))
            seed = int(a.seeds.split(",")[0])
            r = timed(
                "mixed_profiled", mixed(a.requests, vocab, 4096, seed), cache_blocks, True, 0, (first, count)
            )
            report["mixed_profile"] = {"seed": seed, **(r.profile or {})}
        if a.host_profile:  # cProfile slows the launches it records: a run of its own too
            seed = int(a.seeds.split(",")[0])
            r = timed("mixed_host_profiled", mixed(a.requests, vocab, 4096, seed), cache_blocks, True, 0,
                      host_profile=True)
            report["mixed_host_profile"] = {"seed": seed, **(r.host_profile or {})}

    write_json(a.out, report)  # so far: a run cut short keeps what it measured

    if "prefix" in selected:
        work = shared_prefixes(a.prefixes, a.per_prefix, a.prefix_len, vocab, 128, seed=7)
        running = min(MAX_NUM_SEQS, len(work.prompts)) * (64 + 128)
        blocks = -(-int(a.prefix_cache_share * a.prefixes * a.prefix_len + running) // BLOCK)
        blocks = max(blocks, -(-(a.prefix_len + 64 + 128) // BLOCK) * 2)
        on, off = (timed(f"prefix_{m}", work, blocks, m == "on", 0) for m in ("on", "off"))
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

    write_json(a.out, report)  # so far: a run cut short keeps what it measured

    if "oversubscribed" in selected:
        report["oversubscribed"] = []
        for spec in a.oversub.split(","):
            count, prompt, new, ratio = oversubscribed_shape(spec)
            work = fixed(count, prompt, new, vocab, seed=11)
            blocks = -(-int(work.live_tokens / ratio) // BLOCK)
            host = config.kv_offload_blocks
            off_, rec = (
                timed(f"oversub_{spec}_{m}", work, blocks, True, host if m == "offload" else 0)
                for m in ("offload", "recompute")
            )
            # what offloading can save at most: the recompute run's extra prompt tokens, at the
            # GEMM rate (a lower bound on their cost, so the bound on the ratio is a little low)
            recomputed = sum(s["prompt"] for s in rec.steps) - sum(s["prompt"] for s in off_.steps)
            recompute_s = limits.prompt_gemm_s(max(0, recomputed))
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

    write_json(a.out, report)  # so far: a run cut short keeps what it measured

    if "long" in selected:
        work = fixed(a.long_requests, a.long_prompt, a.long_new, vocab, seed=13)
        r = timed("long", work, cache_blocks, True, 0)
        roof = sum(map(limits.decode_memory_s, r.steps))
        floor_s = gemm_floor(r.steps, floor)
        report["long"] = {
            "requests": a.long_requests,
            "prompt": a.long_prompt,
            "new": a.long_new,
            **r.summary(),
            "roofline_s": round(roof, 3),
            "of_roofline": round(roof / r.seconds, 4),
            "gemm_floor_s": round(floor_s, 3),
            "of_gemm_floor": round(floor_s / r.seconds, 4),
            "step_kinds": step_kinds(r.steps, limits),
        }
        rows.append(
            [
                f"long, {a.long_requests} x {a.long_prompt} + {a.long_new}",
                "-",
                r.summary()["tok_s"],
                f"{roof / r.seconds:.1%} of roofline, {floor_s / r.seconds:.1%} of GEMM floor",
            ]
        )

    print(markdown_table(["workload", "runs", "tokens/s", "against"], rows))
    print(f"wrote {write_json(a.out, report)}", file=sys.stderr)


if __name__ == "__main__":
    main()
