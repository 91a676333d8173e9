"""Structured output on CUDA (on a GPU: -m gpu): the mask is filled on the host while the step's
forward runs, uploaded on the copy stream and applied by a sampler that waits for it; constrained
outputs parse, and unconstrained companions (sampled inside the CUDA graphs) keep their tokens."""

from __future__ import annotations

import pytest
from engine_harness import make_core, run
from test_structured_output_engine import _arrivals, _check
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.service.engine.grammar import Grammars

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs,loop,num_blocks",
                         [(True, "async", 64), (True, "async", 10), (False, "sync", 64)])
def test_constrained_outputs_parse_on_cuda_beside_unchanged_companions(tiny_model_dir, graphs, loop,
                                                                      num_blocks):
    path = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(path).to("cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})

    def core():
        built = make_core(model, num_blocks=num_blocks, block_size=16, max_num_seqs=16, max_model_len=160,
                          eos=eos, cuda_graphs=graphs, step_loop=loop)
        built.grammars = Grammars(tokenizer, model.config.vocab_size, eos)
        return built

    alone = run(core(), _arrivals(tokenizer, constrained=False))
    mixed = run(core(), _arrivals(tokenizer, constrained=True))
    assert not mixed.errors
    if num_blocks < 64:
        assert mixed.preemptions > 0, "the small cache was meant to preempt"
    for rid, tokens in mixed.tokens.items():
        if rid.startswith("c"):
            stopped = mixed.finish[rid] == "stop"
            _check(rid, tokenizer.decode(tokens[:-1] if stopped else tokens), mixed.finish[rid])
    for rid, tokens in alone.tokens.items():
        assert mixed.tokens[rid] == tokens, f"{rid} changed beside constrained requests"
