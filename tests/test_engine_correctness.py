"""Continuous batching must not change any request's greedy tokens: engine == transformers generate()."""

from __future__ import annotations

import random

import pytest
import torch
from engine_harness import Arrival, hf_greedy, make_core, run
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine.factory import build_engine
from tandem.service.models.loader import load_model
from tandem.service.settings import ServerSettings

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def _arrivals(vocab: int, lengths: list[int], steps: list[int], max_new: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    return [
        Arrival(f"r{i}", [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=max_new), at)
        for i, (n, at) in enumerate(zip(lengths, steps, strict=True))
    ]


def _check(model: torch.nn.Module, arrivals: list[Arrival], result, eos: list[int] | None) -> None:
    for a in arrivals:
        expected = hf_greedy(model, a.prompt_ids, a.params.max_tokens, eos)
        assert result.tokens[a.request_id] == expected, f"{a.request_id} (prompt {len(a.prompt_ids)} tokens)"


@pytest.fixture(scope="module")
def tiny_models(tiny_model_dir):
    return {f: AutoModelForCausalLM.from_pretrained(tiny_model_dir(f)).eval() for f in FAMILIES}


@pytest.mark.parametrize("loop", ["sync", "async"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_lengths_staggered_arrivals_match_generate(tiny_models, family, loop):
    model = tiny_models[family]
    vocab = model.config.vocab_size
    # long prompts get chunked (budget 48 tokens/step); later arrivals join a batch mid-decode
    arrivals = _arrivals(vocab, [5, 70, 1, 33, 12, 101], [0, 0, 2, 3, 9, 15], max_new=20)
    core = make_core(model, num_blocks=256, block_size=4, max_num_batched_tokens=48, step_loop=loop)
    result = run(core, arrivals)
    assert result.max_batch >= 4
    _check(model, arrivals, result, eos=None)


@pytest.mark.parametrize("loop", ["sync", "async"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_preemption_with_tiny_cache_keeps_tokens(tiny_models, family, loop):
    model = tiny_models[family]
    arrivals = _arrivals(
        model.config.vocab_size, [30, 22, 41, 9, 17, 26], [0, 0, 1, 1, 2, 4], max_new=24, seed=3
    )
    # 24 blocks x 4 = 96 cache slots for six requests of up to 65 tokens each: preemption is forced
    core = make_core(
        model, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96, step_loop=loop
    )
    result = run(core, arrivals)
    assert result.preemptions > 0, "the cache was meant to be too small for all requests at once"
    _check(model, arrivals, result, eos=None)


@pytest.fixture(scope="module")
def smol(smol_dir):
    """The real SmolLM2 and its tokenizer, loaded once for both step loops."""
    from transformers import AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(smol_dir).eval(), AutoTokenizer.from_pretrained(smol_dir)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_real_smollm2_matches_generate(smol, loop):
    model, tok = smol
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Who wrote Hamlet? Answer briefly, then explain why it matters.",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]
    eos = [model.generation_config.eos_token_id]
    arrivals = [
        Arrival(f"q{i}", p, SamplingParams(max_tokens=24), at)
        for i, (p, at) in enumerate(zip(prompts, [0, 0, 3, 6], strict=True))
    ]
    core = make_core(
        model, num_blocks=64, block_size=16, max_num_batched_tokens=64, eos=frozenset(eos), step_loop=loop
    )
    result = run(core, arrivals)
    _check(model, arrivals, result, eos=eos)
    assert "Paris" in tok.decode(result.tokens["q0"])


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_compiled_decode_forward_matches_generate(tiny_models, loop):
    """Decode steps through torch.compile: dynamo traces the model around the paged-decode op.

    aot_eager runs the same tracing and functionalization as inductor (the CUDA default), so the
    op's declared cache mutation must survive it, or later tokens would attend to stale K/V.
    """
    from torch._dynamo.utils import counters

    model = tiny_models["llama"]
    arrivals = _arrivals(model.config.vocab_size, [5, 17, 1, 9], [0, 0, 2, 6], max_new=16, seed=5)
    before = counters["stats"]["unique_graphs"]
    core = make_core(model, num_blocks=128, block_size=4, step_loop=loop, compile_backend="aot_eager")
    result = run(core, arrivals)
    _check(model, arrivals, result, eos=None)
    if loop == "sync":  # the first test compiles; the second reuses the cached graphs
        assert counters["stats"]["unique_graphs"] > before


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_compiled_prefill_matches_generate_without_recompiling(tiny_models, loop):
    """Prefill and mixed steps through torch.compile, their attention one opaque op (mixed_op.py):
    chunked prompts over a cached prefix, lone one-token prompts, decodes mixed with prompts (in
    the async loop, with carried tokens), preemption. The start-up warm-up compiles the forward as
    one frame with no graph break (a break per layer leaves the host slower than the device); no
    step of the run compiles another."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # frames cached by earlier tests would hide what this engine compiles
    model = tiny_models["qwen3"]  # its Q/K norms are in the compiled graph too
    before, breaks = counters["frames"]["ok"], sum(counters["graph_break"].values())
    core = make_core(model, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96,
                     step_loop=loop, compile_backend="aot_eager", compile_decode=False, compile_prefill=True)
    warmed = counters["frames"]["ok"]
    assert warmed == before + 1  # the warm-up compiled the prefill forward, as one frame
    vocab = model.config.vocab_size
    arrivals = _arrivals(vocab, [30, 1, 41, 9, 17, 26, 1, 5], [0, 0, 1, 1, 2, 4, 5, 9], max_new=24, seed=12)
    result = run(core, arrivals)
    assert result.preemptions > 0
    _check(model, arrivals, result, eos=None)
    assert counters["frames"]["ok"] == warmed  # e.g. carried inputs of another tensor kind recompiled
    assert sum(counters["graph_break"].values()) == breaks


def test_compiled_decode_and_prefill_over_one_model_match_generate(tiny_models):
    """Both compiled forwards wrap the same module and share Dynamo's cache of its code (here the
    model itself: the rotary embedding left in the model, as for dynamic RoPE): each step kind
    must still run its own graphs."""
    model = tiny_models["llama"]
    vocab = model.config.vocab_size
    arrivals = _arrivals(vocab, [30, 1, 41, 9, 17, 26], [0, 0, 1, 1, 2, 4], max_new=16, seed=14)
    core = make_core(model, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96,
                     step_loop="async", compile_backend="aot_eager", compile_prefill=True, fold_rotary=False)
    assert core.runner.rotary is None and core.runner.prefill_compiled
    result = run(core, arrivals)
    assert result.preemptions > 0
    _check(model, arrivals, result, eos=None)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_packed_prompt_chunks_match_generate(tiny_models, loop, monkeypatch):
    """The CUDA prefill path that packs every prompt chunk of a step into one variable-length
    flash-attention call, run on the CPU with the reference math in place of the kernel: the
    packing (query rows, context slots of fresh and continued chunks, offsets) must give the
    model's own tokens through chunked prompts over cached prefixes, mixed steps and preemption."""
    from tandem.service.engine.ops import varlen_prefill
    from tandem.service.engine.ops.attention_ref import varlen_causal_attention

    calls = []

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        calls.append((len(cu_q) - 1, max_q, max_k))
        assert cu_q.dtype == cu_k.dtype == torch.int32  # FlashAttention-2 takes nothing else
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        return varlen_causal_attention(q, k, v, cu_q, cu_k, scale)

    monkeypatch.setattr(varlen_prefill, "flash_varlen", reference)
    model = tiny_models["llama"]
    vocab = model.config.vocab_size
    arrivals = _arrivals(vocab, [30, 22, 41, 9, 17, 26], [0, 0, 1, 1, 2, 4], max_new=24, seed=13)
    core = make_core(model, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96,
                     step_loop=loop)
    core.runner.varlen_prefill = True  # what a CUDA device with FlashAttention-2 gets
    result = run(core, arrivals)
    assert result.preemptions > 0
    assert any(n > 1 for n, _, _ in calls) and any(k > q for _, q, k in calls)  # packed, and continued
    _check(model, arrivals, result, eos=None)


def test_fused_projections_compiled_async_matches_unfused_generate(tiny_models):
    """An engine over a fused copy (Qwen2: biased Q/K/V) gives the unfused model's greedy tokens."""
    import copy

    model = tiny_models["qwen2"]
    arrivals = _arrivals(model.config.vocab_size, [5, 17, 1, 9], [0, 0, 2, 6], max_new=16, seed=6)
    core = make_core(copy.deepcopy(model), num_blocks=128, block_size=4, step_loop="async",
                     compile_backend="aot_eager", fuse_projections=True)
    result = run(core, arrivals)
    _check(model, arrivals, result, eos=None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("loop", ["sync", "async"])
def test_head_major_kv_layout_matches_generate(tiny_models, loop, compiled):
    """The HND cache (each KV head's tokens together) through every path: chunked prefill over a
    cached prefix, batched decodes, preemption, and the compiled decode op over its storage."""
    model = tiny_models["qwen3"]
    vocab = model.config.vocab_size
    arrivals = _arrivals(vocab, [30, 22, 41, 9, 17, 26], [0, 0, 1, 1, 2, 4], max_new=24, seed=4)
    core = make_core(model, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96,
                     step_loop=loop, compile_backend="aot_eager" if compiled else None, kv_cache_layout="HND")
    assert core.runner.cache.k_store.shape[1] == model.config.num_key_value_heads
    result = run(core, arrivals)
    assert result.preemptions > 0
    _check(model, arrivals, result, eos=None)


def test_engines_of_different_caches_in_one_process(tiny_models):
    """Inductor-compiled engines, one after another in one process, over caches of other shapes
    (layout, block size, blocks): each must still read and write every layer's own cache. Once a
    second shape has been seen, Dynamo makes the cache's sizes symbolic; with a per-layer view
    handed to the decode op, Inductor then gave every layer layer 0's cache."""
    import copy

    model = tiny_models["llama"]
    arrivals = _arrivals(model.config.vocab_size, [5, 17, 1, 9], [0, 0, 2, 6], max_new=12, seed=8)
    for layout, block_size, num_blocks in [("NHD", 4, 128), ("HND", 4, 128), ("NHD", 8, 96)]:
        core = make_core(copy.deepcopy(model), num_blocks=num_blocks, block_size=block_size,
                         compile_backend="inductor", kv_cache_layout=layout)
        _check(model, arrivals, run(core, arrivals), eos=None)


def test_server_runs_prompts_through_the_plain_model_on_cpu(tiny_model_dir):
    """The compiled prefill and the packed prompt chunks are CUDA's: the CPU server's engine runs
    prefill steps through the model itself (nothing compiled at start-up, no C++ toolchain needed)
    and attends each prompt chunk on its own."""
    loaded = load_model(str(tiny_model_dir("llama")), "tiny", torch.device("cpu"))
    settings = ServerSettings(num_kv_blocks=64, block_size=4, compile=True, compile_prefill=True)
    runner = build_engine(loaded, settings)[0].runner
    assert not runner.prefill_compiled and runner.prefill_forward is loaded.model
    assert not runner.varlen_prefill
