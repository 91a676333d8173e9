"""`tandem bench host`: the engine's host work per step, alone: scheduling, the batch build, staging,
handing tokens back.

    tandem bench host [--batches 32,64,128,256] [--contexts 256,1024,3072] [--steps 100]
    tandem bench host --smoke      # small sizes: checks the logic

The asynchronous loop keeps the device busy only while the host builds step N+1 faster than the
device runs step N, so the host's work per step is a budget against the device's step time (the
8B shape's decode steps of 129-256 rows take about 13 ms on the H200: `tandem bench workloads`,
`decode_by_rows`). This runs the engine core's own loop (`EngineCore.run_once`, asynchronous, with
prefix caching as the server runs it) with the forward replaced by a token fill, so every
millisecond it reports is host work the real step also does. Each stage is timed by wrapping the
engine's own functions: `schedule` (Scheduler.schedule), `build` (ModelRunner.prepare: the step's
host tensors), `upload` (StepBuffers.upload: staging into the slot's buffers and the copies),
`metadata` (a step with prompts: its attention metadata as the CUDA runner builds it, the prompt
chunks packed for one flash-attention call), `process` (EngineCore._process: the tokens handed to
their sequences and the updates made) and `other` (the rest of the turn: the launch's bookkeeping,
the wait, the step record).

Two kinds of point, each with contexts spread uniformly over [C/2, 3C/2]:
- `decode`: B sequences, every one decoding (a steady decode-only step);
- `mixed`: B sequences decoding beside prompts of `--prompt` tokens that fill the rest of the
  step's token budget (2,048), as a mixed step of a busy server.
The host is the machine this runs on: run it on the GPU host to compare with its device steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from tandem.bench.common import SHAPES, markdown_table, percentile
from tandem.bench.engine.harness import environment
from tandem.bench.engine.variants import build_model
from tandem.bench.prompts import mixed
from tandem.bench.record import ResultFile
from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.batch import build_attention_metadata
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.sampler import SampleOutput

BLOCK, MAX_NUM_SEQS, BUDGET = 16, 256, 2048  # the server's defaults
STAGES = ("schedule", "build", "upload", "metadata", "process")
DECODE_ROWS = ((1, 16), (17, 64), (65, 128), (129, 256))  # decode-only steps, by batch size


class StageClock:
    """Wall time of each wrapped engine function, per step (instance attributes: the engine's
    classes are untouched)."""

    def __init__(self, core: EngineCore) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        # per step scheduled: decode rows, prompt tokens, the decode rows' context tokens
        self.shapes: list[tuple[int, int, int]] = []
        sched, runner = core.scheduler, core.runner
        schedule = self._timed("schedule", sched.schedule)

        def recorded() -> object:
            out = schedule()
            if out.chunks:
                decode = [c.start + 1 for c in out.chunks if c.num_tokens == 1]
                self.shapes.append((len(decode), out.num_tokens - len(decode), sum(decode)))
            return out

        sched.schedule = recorded
        runner.prepare = self._timed("build", runner.prepare)
        for slot in runner.slots:
            slot.upload = self._timed("upload", slot.upload)
        core._process = self._timed("process", core._process)
        no_forward(core, self._metadata)

    def _metadata(self, seconds: float) -> None:
        self.spent["metadata"] += seconds

    def _timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args: object, **kwargs: object) -> object:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t

        return wrapper

    def take(self) -> dict[str, float]:
        spent, self.spent = dict(self.spent), defaultdict(float)
        return spent


def _in_place(*args: object) -> None:
    """Stands for the CUDA decode kernel: with one, a step's decode rows need no gather mask."""


def no_forward(core: EngineCore, metadata: Callable[[float], None] | None = None) -> None:
    """The step's forward and sampling replaced by writing a token into each sampled row.
    `metadata`: also build the step's attention metadata as the CUDA runner does for a step with
    prompts (its chunks packed for one flash-attention call, their indexes staged through the
    slot), and hand this callable the seconds it took."""
    runner = core.runner

    def fill(batch, dev, s, bucket, prev_tokens, constrained=False) -> SampleOutput:  # noqa: ANN001 (_compute's)
        if metadata is not None and batch.prefills:
            t = time.perf_counter()
            build_attention_metadata(batch, dev, runner.cache, decode_kernel=_in_place,
                                     varlen=runner.slots[s].stage)
            metadata(time.perf_counter() - t)
        tokens = runner.slots[s].tokens[: len(batch.sample_chunks)]
        return SampleOutput(tokens.fill_(11))

    runner._compute = fill


def point(core: EngineCore, clock: StageClock, kind: str, batch: int, context: int, prompt: int, steps: int,
          vocab: int, seed: int) -> dict:
    """`steps` timed turns of the loop at `batch` decoding sequences (and, mixed, prompts beside them)."""
    rng = random.Random(seed)
    warm = 4
    # the first ones decode while the last ones prefill: none may finish before the timed steps end
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(batch):
        length = rng.randint(context // 2, context * 3 // 2)
        core.add(Request(f"d{i}", [rng.randrange(vocab) for _ in range(length)], params))
    sched = core.scheduler
    while sched.waiting or any(s.num_uncomputed > 1 for s in sched.running):  # prefill them all
        core.run_once()
    prompts = 0

    def feed() -> None:  # keep a step's worth of prompts waiting: each step has its prompt chunks
        nonlocal prompts
        while kind == "mixed" and len(sched.waiting) < 2 * (BUDGET // prompt + 1):
            tokens = [rng.randrange(vocab) for _ in range(prompt)]
            core.add(Request(f"p{prompts}", tokens, SamplingParams(max_tokens=1, ignore_eos=True)))
            prompts += 1

    for _ in range(warm):
        feed()
        core.run_once()
    clock.take()
    clock.shapes.clear()
    totals, stages = [], defaultdict(list)
    for _ in range(steps):
        feed()
        t = time.perf_counter()
        core.run_once()
        totals.append(time.perf_counter() - t)
        for name, spent in clock.take().items():
            stages[name].append(spent)
    shapes = clock.shapes[:steps]
    for seq in list(sched.running) + list(sched.waiting):
        core.abort(seq.request_id)
    while core.has_work:
        core.run_once()
    ms = sorted(1e3 * t for t in totals)
    mean = {name: 1e3 * statistics.fmean(stages[name]) if stages[name] else 0.0 for name in STAGES}
    return {
        "kind": kind,
        "batch": batch,
        "context_mean": context,
        "prompt": prompt if kind == "mixed" else 0,
        "steps": steps,
        "decode_rows_mean": round(statistics.fmean(d for d, _, _ in shapes), 1),
        "prompt_tokens_mean": round(statistics.fmean(p for _, p, _ in shapes), 1),
        "decode_context_mean": round(sum(c for _, _, c in shapes) / max(1, sum(d for d, _, _ in shapes))),
        "ms_mean": round(statistics.fmean(ms), 3),
        "ms_p50": round(percentile(ms, 50), 3),
        "ms_p99": round(percentile(ms, 99), 3),
        "stages_ms": {name: round(v, 3) for name, v in mean.items()}
        | {"other": round(statistics.fmean(ms) - sum(mean.values()), 3)},
    }


def mixed_workload(core: EngineCore, clock: StageClock, requests: int, seed: int) -> dict:
    """The mixed workload (tandem bench workloads' `mixed`, the same seed: the same steps as
    its GPU run) through the loop: the host's work of each turn, by the kind of step it launched."""
    work = mixed(requests, SHAPES["8b"]["vocab_size"], 4096, seed)  # the GPU run's token ids
    for i, (prompt, new) in enumerate(zip(work.prompts, work.new, strict=True)):
        core.add(Request(f"w{i}", prompt, SamplingParams(max_tokens=new, ignore_eos=True)))
    clock.take()
    clock.shapes.clear()
    turns: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
    while core.has_work:
        launched = len(clock.shapes)
        t = time.perf_counter()
        core.run_once()
        seconds, stages = time.perf_counter() - t, clock.take()
        if len(clock.shapes) == launched:
            continue  # a last turn that only finished the step in flight
        decodes, prompt, _ = clock.shapes[-1]
        kind = "mixed" if decodes and prompt else "prompt" if prompt else next(
            f"decode {lo}-{hi} rows" for lo, hi in DECODE_ROWS if decodes <= hi)
        turns[kind].append((seconds, stages))
    groups = {}
    for kind, got in sorted(turns.items()):
        ms = sorted(1e3 * t for t, _ in got)
        groups[kind] = {
            "steps": len(got),
            "ms_mean": round(statistics.fmean(ms), 3),
            "ms_p99": round(percentile(ms, 99), 3),
            "stages_ms": {name: round(1e3 * statistics.fmean(st.get(name, 0.0) for _, st in got), 3)
                          for name in STAGES},
        }
    return {"seed": seed, "requests": requests, "steps": sum(g["steps"] for g in groups.values()),
            "by_kind": groups}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,64,128,256", help="decoding sequences per step")
    ap.add_argument("--contexts", default="256,1024,3072", help="mean context of the decoding sequences")
    ap.add_argument("--mixed-batch", type=int, default=192, help="mixed points: decoding sequences")
    ap.add_argument("--prompt", type=int, default=1024, help="mixed points: tokens of each prompt")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per point")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the server's engine process)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_cpu_host_points.json)")
    ap.add_argument("--workload-seeds", default="",
                    help="also run tandem bench workloads' mixed workload at these seeds: host time per kind "
                    "of step")
    ap.add_argument("--workload-requests", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="small sizes and few steps: checks the logic")
    a = ap.parse_args(argv)
    if a.smoke:
        a.batches, a.contexts, a.mixed_batch, a.prompt, a.steps = "4,16", "64", 8, 96, 8
        a.workload_requests = 24
    a.batches = [int(b) for b in a.batches.split(",")]
    a.contexts = [int(c) for c in a.contexts.split(",")]
    a.workload_seeds = [int(x) for x in a.workload_seeds.split(",")] if a.workload_seeds else []
    return a


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The server's defaults, with a cache that holds every point's sequences (and the workload's)."""
    # the longest context: a prompt, its tokens decoded while the others prefill, the timed steps
    most = max(a.batches + [a.mixed_batch])
    longest = max(a.contexts) * 3 // 2 * (1 + most // BUDGET) + 2 * a.steps + 64
    if a.workload_seeds:  # the mixed workload's prompts and answers: up to 4,096 tokens, 256 at once
        longest, most = max(longest, 4096), MAX_NUM_SEQS
    blocks = (most + 8) * (-(-longest // BLOCK)) + 4 * BUDGET // BLOCK
    return EngineConfig(
        num_blocks=blocks, block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET,
        max_model_len=longest + BLOCK, step_loop="async", prefix_caching=True,
    )


def print_tables(results: list[dict], workloads: list[dict]) -> None:
    for w in workloads:
        print(f"mixed workload, seed {w['seed']}: host work per step, by the kind of step launched")
        print(markdown_table(["step", "steps", "ms/step", "p99", *STAGES],
                             [[kind, g["steps"], g["ms_mean"], g["ms_p99"], *g["stages_ms"].values()]
                              for kind, g in w["by_kind"].items()]))
    columns = ("kind", "decode_rows_mean", "prompt_tokens_mean", "decode_context_mean", "ms_mean", "ms_p99")
    rows = [[*(r[c] for c in columns), *(r["stages_ms"][s] for s in (*STAGES, "other"))] for r in results]
    headers = ["step", "decode rows", "prompt tokens", "context", "ms/step", "p99", *STAGES, "other"]
    print(markdown_table(headers, rows))


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    shape = "points" + ("-mixed-workload" if a.workload_seeds else "")
    result_file = ResultFile("host", argv, device, shape, a.out, tempfile.gettempdir() if a.smoke else None)
    model = build_model("tiny", device, torch.float32)
    core = build_core(model, engine_config(a))
    clock = StageClock(core)  # and the forward replaced
    vocab = model.config.vocab_size
    points = [("decode", b, c) for c in a.contexts for b in a.batches]
    points += [("mixed", a.mixed_batch, c) for c in a.contexts]
    results = []
    for i, (kind, batch, context) in enumerate(points):
        r = point(core, clock, kind, batch, context, a.prompt, a.steps, vocab, seed=i + 1)
        results.append(r)
        print(f"{kind} {batch} x {context}: {r['ms_mean']} ms/step", file=sys.stderr, flush=True)
    workloads = [mixed_workload(core, clock, a.workload_requests, seed) for seed in a.workload_seeds]
    out = result_file.write({
        "benchmark": "host_step",
        "environment": environment(device),
        "engine": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": BUDGET, "block_size": BLOCK,
                   "prefix_caching": True, "step_loop": "async"},
        "smoke": a.smoke,
        "points": results,
        "mixed_workload": workloads,
    })
    print_tables(results, workloads)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
