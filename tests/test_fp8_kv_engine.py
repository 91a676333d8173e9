"""Engines with an FP8 KV cache on the CPU (emulated through casts): the real SmolLM2 generates from
it, and what reuses or moves the cache (prefix caching, KV offload, preemption) changes no token."""

from __future__ import annotations

import random

import grpc
import pytest
import torch
from engine_harness import Arrival, make_core, run
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.service.contract import SamplingParams
from tandem.service.engine.factory import _num_blocks
from tandem.service.engine.ops.kv_cache import CacheShape, KVCache
from tandem.service.engine.ops.kv_quant import FP8
from tandem.service.settings import ServerSettings
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def smol(smol_dir):
    return AutoModelForCausalLM.from_pretrained(smol_dir).eval(), AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()


def _chat(tok, questions: list[str], system: str = "") -> list[list[int]]:
    messages = [[{"role": "system", "content": system}] if system else [] for _ in questions]
    chats = [[*m, {"role": "user", "content": q}] for m, q in zip(messages, questions, strict=True)]
    return [tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] for chat in chats]


def test_smollm2_generates_from_an_fp8_cache_and_prefix_hits_change_no_token(smol):
    """The real model answers from an FP8 cache; requests that find their shared prefix cached (a
    later arrival's system prompt) get the tokens of the same engine without a prefix cache."""
    model, tok = smol
    system = "You are a concise assistant. Answer in one short sentence and do not add anything else."
    prompts = _chat(tok, ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"],
                    system)
    arrivals = [Arrival(f"q{i}", p, SamplingParams(max_tokens=8), at)
                for i, (p, at) in enumerate(zip(prompts, [0, 2, 3], strict=True))]
    results = {}
    for prefix_caching in (False, True):
        core = make_core(model, num_blocks=64, block_size=16, max_num_batched_tokens=128,
                         prefix_caching=prefix_caching, kv_cache_dtype="fp8")
        assert core.runner.cache.k_store.dtype == FP8
        results[prefix_caching] = run(core, arrivals)
    assert results[True].cached["q1"] >= 16 and results[True].cached["q2"] >= 16  # the system prompt
    assert results[True].tokens == results[False].tokens
    assert "Paris" in tok.decode(results[True].tokens["q0"])


@pytest.mark.parametrize("pool", [0, 64], ids=["recompute", "offload"])
def test_preempted_sequences_get_the_tokens_of_an_fp8_engine_that_never_preempts(llama, pool):
    """A cache too small for every request forces preemption: K/V copied to the host pool and back
    (moved as bytes, scales untouched) or recomputed (a fresh prompt attends to its K/V as the
    cache stores them) give every request the tokens of an engine with room for all."""
    rng = random.Random(3)
    vocab = llama.config.vocab_size
    arrivals = [Arrival(f"r{i}", [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=24), at)
                for i, (n, at) in enumerate(zip([30, 22, 41, 9, 17, 26], [0, 0, 1, 1, 2, 4], strict=True))]
    core = make_core(llama, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96,
                     kv_offload_blocks=pool, kv_cache_dtype="fp8")
    core.runner.cache.set_scales(0.5, 0.25)  # scales other than 1 ...
    roomy_core = make_core(llama, num_blocks=256, block_size=4, kv_cache_dtype="fp8")
    roomy_core.runner.cache.set_scales(0.5, 0.25)  # ... the same in both
    roomy = run(roomy_core, arrivals)
    tight = run(core, arrivals)
    s = core.scheduler
    assert (s.preempted_offload if pool else s.preempted_recompute) > 0
    assert tight.tokens == roomy.tokens


def test_compiled_steps_over_an_fp8_cache_give_the_eager_tokens(llama):
    """Decode and prefill compiled by Inductor around the custom ops (their scales as tensor
    arguments, their fake implementations matching) give the eager FP8 engine's tokens."""
    rng = random.Random(5)
    arrivals = [Arrival(f"r{i}", [rng.randrange(llama.config.vocab_size) for _ in range(n)],
                        SamplingParams(max_tokens=12), at)
                for i, (n, at) in enumerate(zip([19, 5, 33], [0, 1, 2], strict=True))]
    tokens = []
    for backend in ("inductor", None):
        core = make_core(llama, compile_backend=backend, compile_prefill=True, kv_cache_dtype="fp8")
        core.runner.cache.set_scales(0.5, 0.25)
        tokens.append(run(core, arrivals).tokens)
    assert tokens[0] == tokens[1]


def test_an_fp8_cache_holds_twice_the_blocks_of_a_bf16_cache_in_one_budget(llama):
    shape = CacheShape.of(llama.config)
    settings = ServerSettings(kv_cache_cpu_gib=0.01)
    bf16 = _num_blocks(settings, shape, torch.bfloat16, torch.device("cpu"))
    assert _num_blocks(settings, shape, FP8, torch.device("cpu")) == 2 * bf16


def test_an_unknown_kv_cache_dtype_is_refused_by_name(llama):
    with pytest.raises(ValueError, match="'int8'.*'auto', 'fp8'"):
        make_core(llama, kv_cache_dtype="int8")


def test_tandem_serve_with_an_fp8_kv_cache(serve, tiny_model_dir):
    """`tandem serve --kv-cache-dtype fp8` sizes its cache in e4m3 and serves; a repeat of a prompt
    finds it cached and gets the same tokens."""
    live = serve("--kv-cache-dtype", "fp8", "--kv-cache-cpu-gib", "0.01")
    shape = CacheShape.of(AutoConfig.from_pretrained(tiny_model_dir("llama")))
    req = pb.GenerateRequest(text="The quick brown fox jumps over the lazy dog. " * 8,
                             stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True))
    with grpc.insecure_channel(live.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        load = stub.GetLoad(pb.LoadRequest(), timeout=30)
        assert load.kv_blocks_total == KVCache.blocks_for_budget(shape, 16, FP8, int(0.01 * 2**30))
        first = stub.Generate(req, timeout=60)
        again = stub.Generate(req, timeout=60)
    assert len(first.token_ids) == 8 and again.token_ids == first.token_ids
    assert again.usage.cached_prompt_tokens > 0
