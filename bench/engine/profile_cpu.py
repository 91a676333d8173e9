"""`tandem bench cpu-profile`: where does a Tandem step go on CPU? The workload of `tandem bench
cpu` (SmolLM2-135M, 16 chat prompts x 128 new tokens, 2 threads), Tandem only.

Wall time per engine stage (the engine's functions wrapped with timers; CPU ops are synchronous, so
wall time is the stage's cost), then the top torch operators over the decode steps (torch.profiler).

    tandem bench cpu-profile [--new 128] [--threads 2] [--ops 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from tandem.bench.common import markdown_table
from tandem.bench.engine.cpu_throughput import TANDEM_SPEC, chat_prompts
from tandem.bench.engine.harness import ForeignLoad, RunStats, blocks_for, run_tandem
from tandem.service.contract import Request, SamplingParams
from tandem.service.engine import engine_core, forward, model_runner, scheduler
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.ops import attention
from tandem.service.engine.step_buffers import StepBuffers
from tandem.service.models.loader import load_model

TOTALS: dict[str, float] = defaultdict(float)
STEP_TIMES: list[float] = []


ORDER: list[str] = []  # stage names in pipeline order, for the table


def timed(name: str, fn: Callable) -> Callable:
    ORDER.append(name)

    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start

    return wrapper


def instrument(model: torch.nn.Module) -> None:
    """Wrap the engine's stages (module globals and class attributes; service/ is not edited)."""
    Core, Runner, Sched = engine_core.EngineCore, model_runner.ModelRunner, scheduler.Scheduler
    step = Core.step

    def timed_step(self: engine_core.EngineCore) -> list:
        start = time.perf_counter()
        try:
            return step(self)
        finally:
            STEP_TIMES.append(time.perf_counter() - start)

    Core.step = timed("EngineCore.step (total)", timed_step)
    Sched.schedule = timed("scheduler.py:Scheduler.schedule", Sched.schedule)
    Runner.prepare = timed("batch_builder.py:StepInputsBuilder.build (ModelRunner.prepare)", Runner.prepare)
    model_runner.build_attention_metadata = timed(
        "batch.py:build_attention_metadata", model_runner.build_attention_metadata
    )
    model.forward = timed("model forward (transformers' LlamaForCausalLM)", model.forward)
    model.model.forward = timed("- decoder layers (LlamaModel)", model.model.forward)
    attention.paged_attention_forward = timed(
        "-- attention.py:paged_attention_forward (all layers)", attention.paged_attention_forward
    )
    model.lm_head.forward = timed("- lm_head (one row per sequence x vocab)", model.lm_head.forward)
    forward.sample = timed("sampler.py:sample", forward.sample)  # the eager step's (forward.py)
    StepBuffers.upload = timed("step_buffers.py:StepBuffers.upload (staging + copies)", StepBuffers.upload)
    Runner.wait = staticmethod(timed("model_runner.py:ModelRunner.wait (.tolist)", Runner.wait))
    Core._process = timed("engine_core.py:EngineCore._process (finish_step, updates)", Core._process)


def stage_table(stats: RunStats, load: ForeignLoad) -> None:
    """Each wrapped stage's wall time per step, and its share of the step."""
    steps = stats.steps or 1
    total = TOTALS["EngineCore.step (total)"]
    rows = [[name, round(1e3 * TOTALS[name] / steps, 2), f"{TOTALS[name] / total:.0%}"] for name in ORDER]
    prefill, decode = STEP_TIMES[0], STEP_TIMES[1:]
    print(f"{stats.tokens} tokens in {stats.seconds:.2f} s ({stats.tok_s:.1f} tokens/s), {steps} steps, "
          f"{1e3 * stats.seconds / steps:.1f} ms/step: prefill step {1e3 * prefill:.0f} ms, "
          f"{len(decode)} decode steps {1e3 * sum(decode) / len(decode):.1f} ms mean "
          f"({1e3 * decode[0]:.0f} ms first, {1e3 * decode[-1]:.0f} ms last)\n")
    if (load.share or 0) + (load.steal or 0) > 0.05:
        print(f"WARNING: other processes took {load.share:.0%} of the CPU, steal {load.steal:.0%}\n")
    print(markdown_table(["stage (- nested in the row above)", "ms/step", "share of step"], rows))


def operator_table(core: object, prompts: list[list[int]], new: int, ops: int, n: int = 20) -> None:
    """The top torch operators of `n` decode steps at mid-length context (self CPU time)."""
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add(Request(f"p{i}", p, params))
    for _ in range(new // 2):  # the prefill step, then decodes
        core.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            core.step()
    while core.scheduler.has_work:
        core.step()
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:ops]
    print(f"\ntop torch operators, {n} decode steps at mid context (self CPU time):\n")
    print(markdown_table(["operator", "ms/step", "calls/step"],
                         [[e.key, round(e.self_cpu_time_total / 1e3 / n, 2), e.count // n] for e in top]))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench cpu-profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", type=int, default=15, help="torch operators to list")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    loaded = load_model(None, None, torch.device("cpu"))
    prompts = chat_prompts(loaded.tokenizer)
    spec = EngineConfig(blocks_for(len(prompts), max(map(len, prompts)) + a.new, 16), **TANDEM_SPEC)
    core = build_core(loaded.model, spec)
    instrument(loaded.model)
    run_tandem(core, prompts, a.new, tag="warm")
    TOTALS.clear()
    STEP_TIMES.clear()
    with ForeignLoad() as load:
        stats = run_tandem(core, prompts, a.new)
    stage_table(stats, load)
    operator_table(core, prompts, a.new, a.ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
