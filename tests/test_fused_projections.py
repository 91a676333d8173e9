"""Fused Q/K/V and gate/up projections compute what the separate layers computed."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_config
from transformers import AutoModelForCausalLM

from tandem.service.engine.ops.fused_projections import FusedLinear, LinearPart, fuse_projections


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])  # qwen2: biased Q/K/V
def test_fused_model_gives_the_same_logits(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_tiny_config(family, 1000)).eval()
    reference = copy.deepcopy(model)
    params_before = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    assert fuse_projections(model) == 2 * layers
    assert fuse_projections(model) == 0  # already fused: nothing left to do
    assert sum(p.numel() for p in model.parameters()) == params_before  # moved, not copied
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, LinearPart) and isinstance(attn.q_k_v_fused, FusedLinear)
    ids = torch.randint(0, 1000, (2, 17))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert attn.q_k_v_fused._input is None  # no activation held between calls


def test_parts_hand_out_slices_in_any_call_order():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(8, n) for n in (4, 2, 3)]
    fused = FusedLinear(linears)
    parts = [LinearPart(fused, i, 8, lin.out_features) for i, lin in enumerate(linears)]
    x = torch.randn(5, 8)
    with torch.no_grad():
        for i in (2, 0, 1):  # the first part called computes for all
            torch.testing.assert_close(parts[i](x), linears[i](x))
        y = torch.randn(5, 8)  # a new input recomputes
        torch.testing.assert_close(parts[1](y), linears[1](y))
