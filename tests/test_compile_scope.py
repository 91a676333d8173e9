"""Compile scope "layer": one decoder layer compiled once and run by every layer gives the tokens of
the whole-model compile and of transformers' generate(), with no recompile per layer."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from engine_harness import Arrival, hf_greedy, make_core, run
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig

from tandem.service.contract import SamplingParams
from tandem.service.engine.compile_scope import CompiledLayer, compile_forward, scope_for
from tandem.service.engine.ops.fp8_linear import quantize_linears
from tandem.service.engine.ops.fused_projections import fuse_projections

MAX_NEW = 6
LAYERS = 5  # more than the 0 and 1 a compiler specialises on: each further layer would be a recompile


def _model(layers: int = LAYERS) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(config).eval()


def _arrivals(vocab: int, seed: int) -> list[Arrival]:
    """A chunked prompt, a one-token prompt, prompts joining decodes."""
    rng = random.Random(seed)
    lengths, steps = [40, 1, 9, 17], [0, 0, 1, 3]
    return [Arrival(f"r{i}", [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=MAX_NEW), at)
            for i, (n, at) in enumerate(zip(lengths, steps, strict=True))]


def _compiled_run(model: torch.nn.Module, scope: str | None, arrivals: list[Arrival], **kw: object):
    """(the run's result, Dynamo frames compiled, ops traced into graphs, graph breaks), from an empty
    Dynamo cache: decode and prefill compiled over `scope` (None: nothing compiled), the async loop
    (carried tokens)."""
    torch._dynamo.reset()
    counters.clear()
    core = make_core(model, num_blocks=64, block_size=4, max_num_batched_tokens=32, max_model_len=96,
                     step_loop="async", compile_backend=None if scope is None else "aot_eager",
                     compile_prefill=True, compile_scope=scope or "model", **kw)
    result = run(core, arrivals)
    return (result, counters["frames"]["ok"], counters["stats"]["calls_captured"],
            sum(counters["graph_break"].values()))


def test_the_layer_scope_compiles_and_traces_as_much_for_five_layers_as_for_one():
    """Every layer runs the frames compiled for the first: a model of five layers compiles as many
    frames as a model of one (one per set of shapes the steps bring; a recompile for each layer's
    index would add some) and traces as many ops, with no graph break; the tokens are generate()'s."""
    one = _model(layers=1)
    model = _model()
    arrivals = _arrivals(model.config.vocab_size, seed=21)
    _, one_frames, one_ops, _ = _compiled_run(one, "layer", arrivals)
    result, frames, ops, breaks = _compiled_run(model, "layer", arrivals)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(model, a.prompt_ids, MAX_NEW, None), a.request_id
    assert frames == one_frames > 0
    assert ops == one_ops
    assert breaks == 0


def test_the_layer_scope_matches_generate_for_qwen3(tiny_model_dir):
    """Qwen3's Q/K norms run inside the compiled layer too."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3")).eval()
    arrivals = _arrivals(model.config.vocab_size, seed=22)
    result, *_ = _compiled_run(model, "layer", arrivals)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(model, a.prompt_ids, MAX_NEW, None), a.request_id


def test_fp8_linears_and_an_fp8_cache_inside_the_compiled_layer():
    """The FP8 GEMM op and an FP8 cache (its scales read by the attention ops at the symbolic layer
    index) inside the compiled layer give the tokens of the same engine run eagerly."""
    model = _model(layers=3)
    reference = copy.deepcopy(model)
    arrivals = _arrivals(model.config.vocab_size, seed=23)
    fp8 = dict(fuse_projections=True, quantization="fp8", kv_cache_dtype="fp8")
    eager, *_ = _compiled_run(reference, None, arrivals, **fp8)
    layered, frames, *_ = _compiled_run(model, "layer", arrivals, **fp8)
    assert frames > 0 and layered.tokens == eager.tokens


def test_a_layered_forward_shares_the_models_modules_and_leaves_the_model_whole():
    model = _model(layers=2)
    fuse_projections(model)
    quantize_linears(model)
    layered = compile_forward(model, "layer", backend="eager")
    assert all(isinstance(layer, CompiledLayer) for layer in layered.model.layers)
    assert [w.layer for w in layered.model.layers] == list(model.model.layers)
    assert layered.model.embed_tokens is model.model.embed_tokens and layered.lm_head is model.lm_head
    assert not any(isinstance(m, CompiledLayer) for m in model.modules())


def test_an_unknown_compile_scope_is_refused_by_name():
    with pytest.raises(ValueError, match="scope 'block'.*model, layer"):
        make_core(_model(layers=2), compile_backend="aot_eager", compile_scope="block")


def test_a_model_without_decoder_layers_compiles_whole():
    assert scope_for("layer", _model(layers=2)) == "layer"
    assert scope_for("layer", torch.nn.Linear(4, 4)) == "model"
    assert scope_for("model", _model(layers=2)) == "model"
