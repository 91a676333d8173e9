"""One timed pass of a workload through the engine core, with what each of its steps was.

`tandem bench workloads` and `tandem bench offload-bound` run the core this way: a fresh scheduler
over the core's cache for each run (its own block count, prefix caching, host pool and step budget),
every request submitted at once, each step's kind and sizes recorded from the scheduler's output.
"""

from __future__ import annotations

import cProfile
import dataclasses
import json
import pstats
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.bench.common import percentile
from tandem.bench.engine.harness import raise_failures, sync, token_rows
from tandem.bench.engine.slow_steps import STEPS
from tandem.bench.prompts import Workload
from tandem.service.contract import Request, SamplingParams, StepTiming
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_scheduler
from tandem.service.engine.engine_core import EngineCore

BLOCK = 16
# KV offload's block counts as a run records them, each from the scheduler's blocks_<name>
OFFLOAD_BLOCKS = {"out": "offloaded", "in": "restored", "reused": "reused", "kept": "kept"}
MAX_NUM_SEQS, BUDGET = 256, 2048  # the server's defaults


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
    assert host_blocks == 0 or (pool is not None and host_blocks <= pool.shape[0])
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
            Request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
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
        for u in token_rows(raise_failures(STEPS.watched(core.run_once))):
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
    """The q-quantile of `values` (seconds) in ms, interpolated as every bench's (common.percentile);
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
    from tandem.bench.kernels.profile_gpu import kernel_kind

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
