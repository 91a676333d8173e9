"""Prompt logprobs (echo / prompt_logprobs) from the engine equal the model's own: a float32
transformers forward over the whole prompt, within 1e-3 per token, whatever the step loop, chunked
prefill, prefix caching or preemption do to the prompt; requests that do not ask keep only their
sampled rows' logits."""

from __future__ import annotations

import random

import pytest
import torch
from engine_harness import make_core
from transformers import AutoModelForCausalLM

from tandem.service.contract import Request, SamplingParams, TokenLogprob
from tandem.service.engine import sampler
from tandem.service.engine.engine_core import EngineCore

TOL = 1e-3


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()


def reference(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: the log-distribution over each prompt token after the first."""
    previous = model.config._attn_implementation  # the engine's paged attention, once it ran
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            logits = model(torch.tensor([prompt], device=device)).logits[0].float().cpu()
    finally:
        model.set_attn_implementation(previous)
    return logits.log_softmax(-1)[:-1]


def drive(core: EngineCore, requests: list[tuple[Request, int]]) -> dict[str, list[TokenLogprob] | None]:
    """Run `requests` (each added at its step) to the end; each one's prompt logprobs as the step
    outputs delivered them (None: none came)."""
    got: dict[str, list[TokenLogprob] | None] = {r.request_id: None for r, _ in requests}
    pending = sorted(requests, key=lambda x: x[1])
    step = 0
    while pending or core.has_work:
        while pending and pending[0][1] <= step:
            core.add(pending.pop(0)[0])
        for out in core.run_once().values():
            assert not out.failed, out.failed
            for row, logprobs in out.prompt_logprobs:
                rid = out.request_ids[row]
                assert got[rid] is None, "prompt logprobs come once, with the first token"
                got[rid] = logprobs
        step += 1
        assert step < 5000
    return got


def check(model: torch.nn.Module, prompt: list[int], got: list[TokenLogprob], top: int) -> None:
    ref = reference(model, prompt)
    assert len(got) == len(prompt) - 1
    for pos, (lp, dist) in enumerate(zip(got, ref, strict=True)):
        target = prompt[pos + 1]
        assert abs(lp.logprob - float(dist[target])) < TOL, f"position {pos + 1}"
        # rank: 1 + the tokens likelier than it (those within the tolerance of it may fall either way)
        assert int((dist > dist[target] + TOL).sum()) < lp.rank <= int((dist > dist[target] - TOL).sum()) + 1
        assert len(lp.top) == top
        ref_top = dist.topk(top)
        for (tid, value), ref_value in zip(lp.top, ref_top.values.tolist(), strict=True):
            assert abs(value - ref_value) < TOL
            assert abs(float(dist[tid]) - value) < TOL


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_prompt_logprobs_equal_the_models_forward_through_chunked_prefill(model, loop, monkeypatch):
    monkeypatch.setattr(sampler, "PROMPT_ROWS_AT_ONCE", 5)  # a chunk's rows in several slices
    prompts = _prompts(model.config.vocab_size, [2, 37, 90, 9])
    core = make_core(model, max_num_batched_tokens=24, step_loop=loop)  # 90 tokens: 4 chunks
    asks = [None, 0, 3, 5]
    requests = [
        (Request(f"r{i}", p, SamplingParams(max_tokens=3, prompt_logprobs=k)), i)
        for i, (p, k) in enumerate(zip(prompts, asks, strict=True))
    ]
    got = drive(core, requests)
    assert got["r0"] is None
    for i in (1, 2, 3):
        check(model, prompts[i], got[f"r{i}"], asks[i])


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_prompt_logprobs_skip_the_prefix_cache_and_survive_preemption(model, loop):
    vocab = model.config.vocab_size
    shared = _prompts(vocab, [24], seed=1)[0]
    tails = _prompts(vocab, [5, 3, 9, 12], seed=2)
    # 20 blocks of 4 for five requests of up to 56 tokens: preemption is forced
    core = make_core(model, num_blocks=20, block_size=4, max_num_batched_tokens=64, step_loop=loop,
                     prefix_caching=True)
    first = Request("warm", shared + tails[0], SamplingParams(max_tokens=2))
    drive(core, [(first, 0)])  # its prompt's blocks are cached now
    requests = [
        (Request(f"r{i}", shared + tail, SamplingParams(max_tokens=20, prompt_logprobs=2)), i)
        for i, tail in enumerate(tails)
    ]
    requests.append((Request("plain", shared + tails[1], SamplingParams(max_tokens=20)), 0))
    got = drive(core, requests)
    seqs_preempted = core.scheduler.preempted_recompute + core.scheduler.preempted_offload
    assert seqs_preempted > 0
    assert core.scheduler.blocks.hit_tokens > 0  # the plain request found the shared prefix
    for i, tail in enumerate(tails):
        check(model, shared + tail, got[f"r{i}"], 2)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_failed_step_s_prompt_logprobs_are_computed_again(model, loop):
    """A step that fails after its launch (its prompt rows marked computed): its sequences are
    recomputed alone (failure containment), and their prompt logprobs come complete all the same."""
    prompts = _prompts(model.config.vocab_size, [50, 30, 9], seed=5)
    core = make_core(model, max_num_batched_tokens=32, step_loop=loop)
    runner, wait = core.runner, core.runner.wait
    failed = []

    def failing_once(step):
        result = wait(step)
        mid_prompt = any(c.seq.request_id == "r0" and c.start > 0 for c in step.out.chunks)
        if mid_prompt and len(step.out.chunks) > 1 and not failed:
            failed.append(step)
            raise RuntimeError("injected")
        return result

    runner.wait = failing_once
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    got = drive(core, [(Request(f"r{i}", p, params), 0) for i, p in enumerate(prompts)])
    assert failed
    for i, p in enumerate(prompts):
        check(model, p, got[f"r{i}"], 1)


def test_steps_without_prompt_logprobs_keep_only_sampled_rows(model, monkeypatch):
    """The hot path's cost: a step of requests that do not ask has no prompt rows, and its forward
    keeps the sampled rows' logits only."""
    import tandem.service.engine.model_runner as model_runner

    kept: list[int] = []
    real = model_runner.forward_and_sample

    def spy(forward, input_ids, dev, meta, keep, tokens, prompt=None):
        kept.append(len(tokens) if isinstance(keep, int) else len(keep))
        assert prompt is None
        return real(forward, input_ids, dev, meta, keep, tokens, prompt)

    monkeypatch.setattr(model_runner, "forward_and_sample", spy)
    core = make_core(model, max_num_batched_tokens=16)
    prompts = _prompts(model.config.vocab_size, [30, 5])
    params = SamplingParams(max_tokens=4, logprobs=True)
    requests = [(Request(f"r{i}", p, params), 0) for i, p in enumerate(prompts)]
    assert drive(core, requests) == {"r0": None, "r1": None}
    assert kept and max(kept) <= 2


@pytest.mark.gpu
def test_cuda_prompt_logprobs_beside_graph_replays(tiny_model_dir):
    """On CUDA, with decode graphs and the asynchronous loop: steps of requests that ask run
    eagerly beside graph-replayed decode steps, and give the model's logprobs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    model = model.to("cuda").eval()
    prompts = _prompts(model.config.vocab_size, [40, 7, 90, 25], seed=4)
    core = make_core(model, num_blocks=64, block_size=16, max_num_batched_tokens=64, max_model_len=256,
                     max_num_seqs=8, cuda_graphs=True, step_loop="async", prefix_caching=True)
    asks = [None, 2, 0, 4]
    requests = [
        (Request(f"r{i}", p, SamplingParams(max_tokens=16, prompt_logprobs=k)), 3 * i)
        for i, (p, k) in enumerate(zip(prompts, asks, strict=True))
    ]
    got = drive(core, requests)
    assert got["r0"] is None
    for i in (1, 2, 3):
        check(model, prompts[i], got[f"r{i}"], asks[i])
