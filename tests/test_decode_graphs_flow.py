"""The decode graphs' path through the engine, run on the CPU: a stand-in for CUDA graph capture
replays a step by running the captured step's code again (`DecodeGraphs._step`: the same views of
the same slot buffers, padded to the bucket as `StepBuffers.upload` pads them), so the graph path's
inputs, padding rows, carried tokens and in-graph sampling decide the tokens. The GPU tests run
the real capture (test_gpu_engine.py)."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_config
from engine_harness import Arrival, hf_greedy, make_core, run
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine import cuda_graphs
from tandem.service.engine.cuda_graphs import DecodeGraphs

ENGINE = dict(num_blocks=8 * 6 + 8, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
              max_model_len=256, step_loop="async")


class _TorchOnCpu:
    """torch as cuda_graphs.py sees it, with the stream and pool calls of its capture made no-ops."""

    def __init__(self) -> None:
        stream = SimpleNamespace(wait_stream=lambda other: None)
        self.cuda = SimpleNamespace(
            graph_pool_handle=lambda: None, Stream=lambda: stream, current_stream=lambda: stream,
            stream=lambda s: contextlib.nullcontext(), synchronize=lambda: None,
        )

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


@pytest.fixture
def replays(monkeypatch) -> Counter:
    """CUDA graph capture replaced by keeping the step to run again at each replay; counts the
    replays by (bucket, sampled in the graph)."""
    monkeypatch.setattr(cuda_graphs, "torch", _TorchOnCpu())
    replayed: Counter = Counter()

    def capture(self: DecodeGraphs, s: int, b: int, sampled: bool, side: object) -> None:
        logits = self._step(s, b, sampled)  # as the real capture's warm-up
        if self.logits[s] is None:
            self.logits[s] = logits.new_empty(self.buckets[-1], logits.shape[-1])

        def replay() -> None:
            replayed[(b, sampled)] += 1
            out = self._step(s, b, sampled)
            if not sampled:
                self.logits[s][:b].copy_(out)

        self.graphs[(s, b, sampled)] = SimpleNamespace(replay=replay)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", capture)
    return replayed


def _core_with_graphs(
    model: torch.nn.Module, compile_backend: str | None = None, compile_scope: str = "model"
):
    core = make_core(model, **ENGINE, compile_backend=compile_backend, compile_scope=compile_scope)
    runner = core.runner
    assert runner.graphs is None  # the CPU resolves graphs off; the stand-in puts them back
    runner.graphs = DecodeGraphs(runner.decode_forward, runner.cache, runner.slots, runner.rotary)
    runner.graphs.capture()
    return core


@pytest.mark.parametrize(("compile_backend", "compile_scope"),
                         [(None, "model"), ("aot_eager", "model"), ("aot_eager", "layer")],
                         ids=["eager-forward", "compiled-forward", "compiled-layers"])
def test_graph_steps_give_the_eager_engines_tokens(replays, compile_backend, compile_scope):
    """Five requests arriving over the first steps and ending at different lengths: decode steps of
    5, 4, 3, 2 and 1 rows replay the graphs of buckets 8, 4, 2 and 1 with padding rows, while steps
    with prompts run eagerly; greedy, seeded-sampled (sampled inside the graph), top-k (sampled on
    the greedy graph's logits) and log-probability requests side by side. Every token equals the
    engine's without graphs, the greedy ones transformers' generate(); with the decode forward
    compiled (the whole model, or the layer every layer runs), every shape was compiled as the
    graphs were captured and no step compiles after."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_tiny_config("llama", 1000)).eval()
    rng = random.Random(5)
    kinds = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=22, temperature=0.8, seed=7),
             SamplingParams(max_tokens=14, temperature=0.9, top_k=20, seed=3),
             SamplingParams(max_tokens=9, logprobs=2), SamplingParams(max_tokens=5)]
    arrivals = [Arrival(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(20, 40))], params, i)
                for i, params in enumerate(kinds)]
    eager = run(make_core(model, **ENGINE), arrivals)
    core = _core_with_graphs(model, compile_backend, compile_scope)
    compiled = counters["frames"]["ok"]
    result = run(core, arrivals)
    assert not result.errors and not eager.errors
    assert result.tokens == eager.tokens
    assert {b for b, _ in replays} == {1, 2, 4, 8} and any(sampled for _, sampled in replays)
    if compile_backend is not None:
        assert counters["frames"]["ok"] == compiled
    for a in (arrivals[0], arrivals[4]):
        assert result.tokens[a.request_id] == hf_greedy(model, a.prompt_ids, a.params.max_tokens, None)


@pytest.mark.parametrize("pool", [0, 64], ids=["recompute", "offload"])
def test_graph_steps_through_preemption_give_generates_tokens(replays, pool):
    """Seven requests in a cache of 96 slots: sequences are preempted and come back (recomputed, or
    their K/V copied to the host pool and back) while decode steps replay graphs whose rows change
    sequence from step to step; every token is generate()'s."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_tiny_config("llama", 1000)).eval()
    rng = random.Random(3)
    lengths, steps = [30, 22, 41, 9, 17, 26, 35], [0, 0, 1, 1, 2, 4, 6]
    arrivals = [Arrival(f"r{i}", [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=24), at)
                for i, (n, at) in enumerate(zip(lengths, steps, strict=True))]
    core = make_core(model, num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                     max_model_len=96, step_loop="async", kv_offload_blocks=pool)
    runner = core.runner
    runner.graphs = DecodeGraphs(runner.decode_forward, runner.cache, runner.slots, runner.rotary)
    runner.graphs.capture()
    result = run(core, arrivals)
    assert not result.errors and result.preemptions > 0 and sum(replays.values()) > 0
    s = core.scheduler
    assert (s.preempted_offload > 0) == bool(pool) and (s.preempted_recompute > 0) == (not pool)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(model, a.prompt_ids, 24, None), a.request_id
