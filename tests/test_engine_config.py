"""What build_core settles from an EngineConfig before it builds anything (core_builder.resolve),
on the CPU: the step loop, the context length and the device paths the runner then reads."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_config
from transformers import AutoModelForCausalLM

from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import resolve
from tandem.service.engine.model_runner import ModelRunner
from tandem.service.engine.ops.kv_cache import CacheShape, KVCache


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_tiny_config("llama", 128)).eval()


def test_auto_and_the_cuda_paths_settle_off_on_the_cpu(tiny_model):
    asked = EngineConfig(num_blocks=8, block_size=16)  # every device path asked for, the loop left to "auto"
    assert asked.cuda_graphs and asked.in_place_decode and asked.varlen_prefill
    config = resolve(asked, tiny_model)
    assert config.step_loop == "sync"
    assert not (config.cuda_graphs or config.in_place_decode or config.varlen_prefill)
    assert config.max_model_len == 8 * 16  # the model's 1024 positions, capped by what the cache holds
    assert resolve(config, tiny_model) == config  # settled: nothing left to settle


def test_what_a_config_says_outright_is_kept(tiny_model):
    asked = EngineConfig(num_blocks=8, block_size=16, step_loop="async", max_model_len=64, cuda_graphs=False)
    config = resolve(asked, tiny_model)
    assert config.step_loop == "async" and config.max_model_len == 64 and not config.cuda_graphs


def test_a_cache_too_small_to_serve_is_refused(tiny_model):
    with pytest.raises(ValueError, match="the KV cache holds 1 tokens: too small to serve anything"):
        resolve(EngineConfig(num_blocks=1, block_size=1), tiny_model)


def test_the_runner_takes_only_a_resolved_config(tiny_model):
    """The runner reads the device paths as given: a config that skipped resolve (every path still
    on, as asked) would send a CPU model to the Triton kernel, so it is refused."""
    asked = EngineConfig(num_blocks=8, block_size=16)
    cache = KVCache(CacheShape.of(tiny_model.config), 8, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(AssertionError, match="through core_builder.resolve"):
        ModelRunner(tiny_model, cache, asked)
    assert ModelRunner(tiny_model, cache, resolve(asked, tiny_model)).decode_kernel is None
