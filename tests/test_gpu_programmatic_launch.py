"""Programmatic dependent launch (ops/programmatic_launch.py) on a Hopper GPU (-m gpu): an engine
whose kernels launch early and wait for their predecessors gives the tokens of one whose kernels
launch in stream order, through compiled forwards and CUDA graphs, in bf16 and in FP8."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_config
from engine_harness import Arrival, make_core, run
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine.ops import programmatic_launch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [(None, "auto"), ("fp8", "fp8")])
def test_an_engine_launching_its_kernels_early_gives_the_same_tokens(quantization, kv_cache_dtype):
    if not programmatic_launch.supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    rng = random.Random(2)
    arrivals = [Arrival(f"r{i}", [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=32), at)
                for i, (n, at) in enumerate(zip([7, 60, 2, 33, 15, 90, 5], [0, 0, 1, 3, 8, 12, 12],
                                                strict=True))]
    results = []
    for early in (False, True):
        torch.manual_seed(0)  # the same weights; each engine fuses (and quantizes) its own model
        model = AutoModelForCausalLM.from_config(make_tiny_config("llama", 1000)).to("cuda", torch.bfloat16)
        core = make_core(model.eval(), num_blocks=64, block_size=16, max_num_batched_tokens=64,
                         max_model_len=256, max_num_seqs=8, cuda_graphs=True, step_loop="async",
                         compile_backend="inductor", fuse_projections=True, compile_prefill=True,
                         quantization=quantization, kv_cache_dtype=kv_cache_dtype, programmatic_launch=early)
        assert core.config.programmatic_launch is early and programmatic_launch.enabled() is early
        results.append(run(core, arrivals))
    assert results[1].tokens == results[0].tokens
    programmatic_launch.enable(False)
