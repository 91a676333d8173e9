"""The engine benchmarks' harness: drive Tandem's EngineCore and transformers' `generate_batch` on the
same prompts, time them after a warm-up run, and say what else the machine did meanwhile.

Only `tandem.service.engine.*` and the contract it speaks (`tandem.service.contract`) are imported: no
settings (pydantic-settings), no gRPC, no asyncio, so the engine benchmarks run on a GPU host that has
only torch, transformers and msgspec beside Tandem.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from tandem.bench.common import percentile, refuse
from tandem.bench.engine.slow_steps import STEPS
from tandem.bench.record import machine
from tandem.service.contract import FinishReason, Outputs, Request, SamplingParams
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.gc_pauses import GcPauses, freeze_start_up_heap
from tandem.service.engine.ops.attention import register


@dataclass(frozen=True, slots=True)
class TokenRow:
    """One request's new token in one turn of the engine's loop, as its front would read it."""

    request_id: str
    token: int
    cached: int | None  # on a request's first token: its prompt tokens the prefix cache held
    finish: FinishReason | None  # set on its last token


def token_rows(outputs: Outputs) -> Iterator[TokenRow]:
    """The new tokens of one turn of `EngineCore.run_once` (every front's outputs, row by row)."""
    for out in outputs.values():
        started = {row: cached for row, _at, cached in out.started}
        finished = {row: reason for row, reason, _stop in out.finished}
        for row, (rid, token) in enumerate(zip(out.request_ids, out.tokens, strict=True)):
            yield TokenRow(rid, token, started.get(row), finished.get(row))


def failures(outputs: Outputs) -> list[tuple[str, str]]:
    """(request id, why) of the requests that failed in one turn of the engine's loop."""
    return [(rid, why) for out in outputs.values() for rid, _kind, why in out.failed]


def raise_failures(outputs: Outputs) -> Outputs:
    """`outputs`, unless a request failed in them: a benchmark's requests must all succeed."""
    for rid, why in failures(outputs):
        raise RuntimeError(f"{rid}: {why}")
    return outputs


@dataclass
class RunStats:
    """One timed generation: every request produced exactly `new_tokens` tokens."""

    name: str
    seconds: float
    tokens: int
    steps: int | None = None
    warmup_seconds: float | None = None
    step_ms: dict[str, float] = field(default_factory=dict)  # Tandem: median / p90 / max step time
    # Tandem: the wall time in steps of more than SLOW_STEP times the median (prompt steps, stalls)
    slow_steps: dict[str, float] = field(default_factory=dict)
    all_runs: list[dict] = field(default_factory=list)  # every timed run, in order, with the machine's load
    foreign_cpu: float | None = None  # share of the machine's CPU other processes used meanwhile
    cpu_steal: float | None = None  # share of it the hypervisor gave to other machines
    gpu_busy: float | None = None  # mean NVML utilization (share of time a kernel ran), when sampled
    engine_idle: float | None = None  # Tandem: 1 - its steps' device time / wall time (CUDA: event-timed)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "outputs"}
        out["tok_s"] = round(self.tok_s, 1)
        out["seconds"] = round(self.seconds, 3)
        if self.steps:
            out["ms_per_step"] = round(1e3 * self.seconds / self.steps, 2)
        return out


def blocks_for(num_requests: int, tokens_per_request: int, block_size: int, margin: float = 1.25) -> int:
    """KV blocks that hold every request at full length at once, with some margin."""
    per_request = -(-tokens_per_request // block_size)
    return int(num_requests * per_request * margin) + 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# -- Tandem ----------------------------------------------------------------------------------------


SLOW_STEP = 3.0  # a step this many times the median: a prompt's, or a stall


def run_tandem(core: EngineCore, prompts: Sequence[list[int]], new_tokens: int, tag: str = "") -> RunStats:
    """Add every request, then run the core's loop (sync or async) until all are done; greedy,
    exactly `new_tokens` each."""
    core.runner.model.set_attn_implementation(register())  # generate_batch may have switched it
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    device = core.runner.device
    sync(device)
    start, first_step, busy_before = time.perf_counter(), core.steps, core.busy_seconds
    for rid, prompt in zip(ids, prompts, strict=True):
        core.add(Request(rid, list(prompt), params))
    step_times = []
    while core.has_work:
        before, step_start = core.steps, time.perf_counter()
        for row in token_rows(raise_failures(STEPS.watched(core.run_once))):
            outputs[row.request_id].append(row.token)
        if core.steps == before and not core.step_in_flight:
            raise RuntimeError("the scheduler scheduled nothing while work was pending")
        step_times.append(1e3 * (time.perf_counter() - step_start))
    sync(device)
    seconds = time.perf_counter() - start
    stats = _checked("tandem", seconds, [outputs[r] for r in ids], new_tokens, core.steps - first_step)
    # the engine's own idle fraction over the run: 1 - device time of its steps / wall time
    stats.engine_idle = round(max(0.0, 1 - (core.busy_seconds - busy_before) / seconds), 4)
    stats.step_ms = {k: round(percentile(step_times, q), 2)
                     for k, q in (("median", 50), ("p90", 90), ("max", 100))}
    stats.slow_steps = slow_steps(step_times, seconds)
    return stats


def slow_steps(step_times_ms: Sequence[float], wall_s: float) -> dict[str, float]:
    """The steps of more than SLOW_STEP times the median: how many, their seconds and their share of
    the wall time."""
    bound = SLOW_STEP * percentile(list(step_times_ms), 50)
    slow = [ms for ms in step_times_ms if ms > bound]
    seconds = sum(slow) / 1e3
    return {"count": len(slow), "seconds": round(seconds, 3), "of_wall": round(seconds / wall_s, 3)}


# -- transformers ----------------------------------------------------------------------------------


def run_hf(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    new_tokens: int,
    cb_config: dict | None = None,
    attn: str = "sdpa",
    persistent: bool = False,
) -> RunStats:
    """transformers' continuous batching, `generate_batch`, greedy, fixed length.

    eos_token_id=-1 disables the stop token (transformers drops negative ids), so every request runs
    `new_tokens`. generate_batch switches `attn` to `paged|attn` for the call and restores it after.
    Each call builds its manager (cache, static tensors, CUDA graphs) inside the timed call, as
    hf_cb_anchor.py measured; `persistent=True` keeps the manager of the first call for the next ones
    (so only the warm-up pays for it, as Tandem's engine is built outside its timed runs); then call
    `release_hf(model)` afterwards. The cached manager ignores a changed `cb_config`.
    """
    from transformers import GenerationConfig
    from transformers.generation import configuration_utils as cu

    model.set_attn_implementation(attn)  # Tandem leaves `tandem_paged` set, which generate_batch can't use
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs = {}
    cbc_class = getattr(cu, "ContinuousBatchingConfig", None)
    if cbc_class is not None:
        kwargs["continuous_batching_config"] = cbc_class(**(cb_config or {}))
    device = model_device(model)
    sync(device)
    start = time.perf_counter()
    out = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=gen, progress_bar=False,
                               persistent_manager=persistent, **kwargs)
    sync(device)
    seconds = time.perf_counter() - start
    results = list(out.values())
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"generate_batch failed: {errors[0]}")
    if len(results) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} requests")
    # the dict comes back in input order
    return _checked("transformers", seconds, [r.generated_tokens for r in results], new_tokens)


def need_generate_batch(benchmark: str, alternative: str = "") -> None:
    """Refuse unless this transformers has continuous batching (`generate_batch`)."""
    from transformers import LlamaForCausalLM

    if not hasattr(LlamaForCausalLM, "generate_batch"):
        refuse(benchmark, f"needs transformers' continuous batching (generate_batch, transformers "
               f"{transformers.__version__} has none){alternative}")


def release_hf(model: torch.nn.Module) -> None:
    """Free a manager kept by `run_hf(..., persistent=True)` (its KV cache, graphs)."""
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()


def _checked(name: str, seconds: float, outputs: list[list[int]], new_tokens: int, steps: int | None = None
             ) -> RunStats:
    short = [len(o) for o in outputs if len(o) != new_tokens]
    if short:
        raise RuntimeError(f"{name}: {len(short)} requests did not produce {new_tokens} tokens ({short[:4]})")
    return RunStats(name, seconds, sum(len(o) for o in outputs), steps, outputs=outputs)


def same_outputs(a: RunStats, b: RunStats) -> int:
    """How many requests got identical tokens from both runs (greedy: a correctness cross-check)."""
    return sum(x == y for x, y in zip(a.outputs, b.outputs, strict=True))


# -- timing, environment, output -------------------------------------------------------------------


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of this machine, all cores, since boot, from /proc/stat. Steal is time the
    hypervisor gave our virtual CPUs to someone else."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = f[0] + f[1] + f[2] + f[5] + f[6]  # user nice system irq softirq
    return busy / tick, f[7] / tick


class ForeignLoad:
    """While the block runs: share of the machine's CPU time used by OTHER processes (`share`), and share
    stolen by the hypervisor (`steal`). 0 and 0 = a quiet machine; CPU numbers are unreliable otherwise."""

    def __enter__(self) -> ForeignLoad:
        self.share: float | None = None
        self.steal: float | None = None
        self._cpu, self._own, self._wall = _cpu_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        cpu = _cpu_seconds()
        if cpu is None or self._cpu is None:
            return
        capacity = (time.perf_counter() - self._wall) * (os.cpu_count() or 1)
        foreign = (cpu[0] - self._cpu[0]) - (time.process_time() - self._own)
        self.share = round(max(0.0, foreign / capacity), 3)
        self.steal = round((cpu[1] - self._cpu[1]) / capacity, 3)


class StallWatch:
    """What can hold up a timed run's steps besides the work: Python's garbage collections (full
    ones walk every object), Dynamo compiling a frame, Triton compiling a variant of the engine's
    kernels; and where steps that ran long spent their time (slow_steps.py). Each timed run reports
    them beside its slowest step."""

    def __enter__(self) -> StallWatch:
        self.pauses = GcPauses().__enter__()
        STEPS.start()
        self.frames, self.variants = _frames_compiled(), _kernel_variants()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pauses.__exit__()
        slow_step_stacks = STEPS.stop()
        gc = self.pauses.totals()
        self.seen = {
            "gc_full_collections": gc.collections[2],
            "gc_full_s": round(gc.seconds[2], 3),
            "gc_s": round(sum(gc.seconds), 3),
            "frames_compiled": _frames_compiled() - self.frames,
            "kernel_variants_compiled": _kernel_variants() - self.variants,
            "slow_step_stacks": slow_step_stacks,
        }


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def _kernel_variants() -> int:
    if not torch.cuda.is_available():  # the engine's Triton kernels run on CUDA only
        return 0
    from tandem.service.engine.ops.triton_variants import compiled_variants

    return compiled_variants()


def measure(runs: dict[str, Callable[[], RunStats]], repeat: int = 1) -> dict[str, RunStats]:
    """Warm each run up once (allocations, kernels, graph capture; the heap then frozen, as the server
    does), then time `repeat` rounds of all runs, interleaved so that a drifting machine (clock,
    neighbours) treats them alike; the fastest of each wins."""
    best: dict[str, RunStats] = {}
    warmup: dict[str, float] = {}
    runs_of: dict[str, list[dict]] = {}
    for name, run in runs.items():
        start = time.perf_counter()
        run()
        warmup[name] = round(time.perf_counter() - start, 2)
    freeze_start_up_heap()  # as the server's engine process serves (gc_pauses.py)
    for _ in range(repeat):
        for name, run in runs.items():
            with ForeignLoad() as load, StallWatch() as stalls:
                stats = run()
            stats.name = name
            stats.foreign_cpu, stats.cpu_steal = load.share, load.steal
            runs_of.setdefault(name, []).append(
                {"seconds": round(stats.seconds, 3), "foreign_cpu": load.share, "cpu_steal": load.steal,
                 **({"step_ms_max": stats.step_ms["max"]} if stats.step_ms else {}), **stalls.seen})
            if name not in best or stats.seconds < best[name].seconds:
                best[name] = stats
    for name, stats in best.items():
        stats.warmup_seconds, stats.all_runs = warmup[name], runs_of[name]
    return best


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 1024**3, reps: int = 20) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    seconds = (time.perf_counter() - start) / reps
    del x, y
    return 2 * nbytes / seconds


def environment(device: torch.device) -> dict:
    env = {
        **machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env
