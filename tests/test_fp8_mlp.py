"""The FP8 gated MLP (service/engine/ops/fp8_mlp.py): which MLPs the engine replaces, and that the
replacement computes exactly what the model's own MLP over the same FP8 layers computes; the fused
SiLU-product-quantization kernel on Triton's CPU interpreter (`make test` runs those tests with
TRITON_INTERPRET=1; test_gpu_fp8_mlp.py runs the kernel on a GPU)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_config
from transformers import AutoModelForCausalLM

from tandem.service.engine.ops.fp8_linear import FP8, Fp8Linear, quantize_linears, quantize_rows
from tandem.service.engine.ops.fp8_mlp import Fp8GatedMLP, fuse_fp8_mlps, silu_mul_quant
from tandem.service.engine.ops.fused_projections import fuse_projections


def _tiny(family: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_tiny_config(family, 1000)).eval()


def _as_the_engine_builds_it(model: torch.nn.Module) -> torch.nn.Module:
    fuse_projections(model)
    quantize_linears(model)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_gated_mlp_of_an_fp8_model_computes_as_before(family):
    model = _as_the_engine_builds_it(_tiny(family))
    reference = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert fuse_fp8_mlps(model) == layers
    assert all(isinstance(layer.mlp, Fp8GatedMLP) for layer in model.model.layers)
    assert fuse_fp8_mlps(model) == 0  # nothing left to replace
    ids = torch.randint(0, 1000, (2, 19))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_mlps_the_op_does_not_reproduce_are_left_as_they_are():
    bf16 = _tiny()
    fuse_projections(bf16)  # fused, not FP8
    assert fuse_fp8_mlps(bf16) == 0
    unfused = _tiny()
    quantize_linears(unfused)  # FP8, gate and up separate
    assert fuse_fp8_mlps(unfused) == 0
    gelu = _as_the_engine_builds_it(_tiny())
    gelu.model.layers[0].mlp.act_fn = torch.nn.GELU()  # another activation
    assert fuse_fp8_mlps(gelu) == gelu.config.num_hidden_layers - 1
    assert not isinstance(gelu.model.layers[0].mlp, Fp8GatedMLP)

    class ScaledMLP(type(_tiny().model.layers[0].mlp)):  # another forward
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    other = _as_the_engine_builds_it(_tiny())
    other.model.layers[1].mlp.__class__ = ScaledMLP
    assert fuse_fp8_mlps(other) == other.config.num_hidden_layers - 1
    assert not isinstance(other.model.layers[1].mlp, Fp8GatedMLP)


def test_the_op_is_the_rows_quantized_product_on_the_cpu():
    torch.manual_seed(1)
    gate_up = torch.randn(5, 2 * 96, dtype=torch.bfloat16) * 4
    q, scale = silu_mul_quant(gate_up)
    ref_q, ref_scale = quantize_rows(F.silu(gate_up[:, :96]) * gate_up[:, 96:])
    assert q.dtype == FP8 and q.shape == (5, 96) and scale.shape == (5, 1)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    empty_q, empty_scale = silu_mul_quant(gate_up[:0])
    assert empty_q.shape == (0, 96) and empty_scale.shape == (0, 1)


def test_the_mlp_traces_into_a_compiled_graph():
    """The op is opaque to the compiler (its fake tensors): the replaced MLP compiles whole."""
    model = _as_the_engine_builds_it(_tiny())
    fuse_fp8_mlps(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 7, model.config.hidden_size)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), mlp(x))
    assert isinstance(mlp.down, Fp8Linear)


# --- the CUDA kernel, run by Triton's interpreter on the CPU ---------------------------------------


@pytest.mark.parametrize(("rows", "width"), [(1, 96), (4, 1536), (3, 1000)])
def test_the_kernel_quantizes_the_rows_product(rows, width):
    """Within e4m3's rounding of the reference (the interpreter rounds float32 to e4m3 wrongly now
    and then where the rounding carries into the exponent: test_fp8_kv_cache.py)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 (Triton reads it when it is first imported)")
    from tandem.service.engine.ops.triton_silu_mul_quant import silu_mul_quant_rows

    torch.manual_seed(rows * width)
    gate_up = torch.randn(rows, 2 * width) * 3
    gate_up[0, :width] = 0.0  # a row of zeros keeps a usable scale
    q, scale = silu_mul_quant_rows(gate_up)
    product = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    ref_q, ref_scale = quantize_rows(product)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    got, ref = q.float(), ref_q.float()
    step = (ref.abs() / 8).clamp(min=2**-9)  # one e4m3 step at each value
    # the interpreter's carry: a value that rounds up to a power of two comes out as half of it
    carried = (got * 2 == ref) & (torch.frexp(ref)[0].abs() == 0.5)
    assert (((got - ref).abs() <= step) | carried).all()
    assert ((got != ref) & ~carried).float().mean() < 0.01
