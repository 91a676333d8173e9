"""The rotary embedding applied by the attention ops (deferred_rotary.py), on CPU: the decode op
for decode steps, the mixed op for steps with prompts.

The GPU side (the Triton kernels rotating Q and the new K) is test_gpu_kernels.py's
test_kernel_rotates_query_and_new_key and test_write_kernel_stores_the_steps_kv_and_rotates;
engines over every family on CUDA are test_gpu_engine.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_harness import Arrival, hf_greedy, make_core, run
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from tandem.service.contract import SamplingParams
from tandem.service.engine.factory import build_engine
from tandem.service.engine.ops.deferred_rotary import defer_rotary, rotate
from tandem.service.models.loader import load_model
from tandem.service.settings import ServerSettings

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
             "original_max_position_embeddings": 256},
}


def _llama(rope: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", list(ROPES))
def test_op_rotation_is_transformers_rotation(rope, dtype):
    """rotate() (the op's CPU path, the kernel's reference) gives transformers' rotated Q and K bit
    for bit, for each RoPE type the deferred model defers, attention scaling included (yarn)."""
    model = _llama(ROPES[rope]).to(dtype)
    head_dim = 16
    deferred, rotary = defer_rotary(model, head_dim)
    assert rotary is not None and deferred is not model
    positions = torch.tensor([0, 1, 17, 255, 1000, 2047])
    q = torch.randn(len(positions), 4, head_dim, dtype=dtype)  # [B, H, D], as the op sees them
    k = torch.randn(len(positions), 2, head_dim, dtype=dtype)
    cos, sin = model.model.rotary_emb(q, positions[None])  # [1, B, D]
    q_hf, k_hf = modeling_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                     cos, sin)
    q_op, k_op = rotate(positions, rotary, q, k)
    assert torch.equal(q_op, q_hf[0].transpose(0, 1))
    assert torch.equal(k_op, k_hf[0].transpose(0, 1))


def test_deferred_model_leaves_rotary_to_the_ops_and_the_model_untouched():
    model = _llama(ROPES["default"])
    deferred, _ = defer_rotary(model, 16)
    x, positions = torch.randn(1, 3, 64), torch.tensor([[4, 5, 6]])
    cos, sin = deferred.model.rotary_emb(x, positions)
    assert cos.shape == (1, 3, 0) and sin.shape == (1, 3, 0)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    assert modeling_llama.apply_rotary_pos_emb(q, k, cos, sin) == (q, k)  # passed through unrotated
    # the model itself, and every module but the rotary embedding, are shared and unchanged
    real_cos, _ = model.model.rotary_emb(x, positions)
    assert real_cos.shape == (1, 3, 16)
    assert deferred.model.layers is model.model.layers and deferred.lm_head is model.lm_head
    assert deferred.model.embed_tokens.weight is model.model.embed_tokens.weight


def test_dynamic_rope_stays_in_the_model():
    """A RoPE type whose frequencies follow the sequence length is not one the op reproduces."""
    model = _llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    deferred, rotary = defer_rotary(model, 16)
    assert rotary is None and deferred is model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_defers_and_matches_generate(tiny_model_dir, family):
    """Each family's steps run with the rotary left to the ops, prompt and decode steps alike, and
    greedy tokens stay transformers' own (with the rotation skipped and not done by the ops they
    would not)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family)).eval()
    with torch.no_grad():  # sharp attention: random init alone attends almost uniformly, position-blind
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    rng = random.Random(1)
    prompt = lambda n: [rng.randrange(model.config.vocab_size) for _ in range(n)]  # noqa: E731
    arrivals = [Arrival(f"r{i}", prompt(n), SamplingParams(max_tokens=12), at)
                for i, (n, at) in enumerate([(9, 0), (40, 0), (3, 2), (17, 5)])]
    for fold in (True, False):
        core = make_core(model, num_blocks=64, block_size=4, fold_rotary=fold)
        assert (core.runner.rotary is not None) == fold
        result = run(core, arrivals)
        for a in arrivals:
            expected = hf_greedy(model, a.prompt_ids, 12, None)
            assert result.tokens[a.request_id] == expected, (fold, a.request_id)


def test_server_leaves_rotary_in_the_model_on_cpu(tiny_model_dir):
    """`fold_rotary` is a CUDA setting: on the CPU the op's eager rotation shows no gain over the
    model's own (docs/architecture.md), so the server's CPU engine keeps the model's."""
    loaded = load_model(str(tiny_model_dir("llama")), "tiny", torch.device("cpu"))
    settings = ServerSettings(num_kv_blocks=64, block_size=4, fold_rotary=True)
    assert build_engine(loaded, settings)[0].runner.rotary is None
