"""FP8 linear layers (W8A8): the quantization's rounding, the scaled GEMM against its dequantized
reference, which layers a model quantizes, and an engine running them (in process and through
`tandem serve`) giving the tokens transformers' generate() gives on the same quantized model."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch
from conftest import make_tiny_config
from engine_harness import Arrival, hf_greedy, make_core, run
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine.ops.fp8_linear import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    compile_gemm_variants,
    compute_dtype,
    gemm_kernel,
    quantize_linears,
    quantize_rows,
)
from tandem.service.engine.ops.fp8_mlp import Fp8GatedMLP
from tandem.service.engine.ops.fused_projections import FusedLinear, fuse_projections
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


def test_rows_quantize_to_their_largest_magnitude_within_e4m3_rounding():
    torch.manual_seed(0)
    x = torch.randn(8, 256) * torch.logspace(-3, 2, 8)[:, None]  # rows of very different ranges
    x[3] = 0.0  # a row of zeros keeps a usable scale
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (8, 1) and torch.isfinite(scale).all()
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a normal value; below 2**-6 the step is 2**-9
    bound = torch.maximum(x.abs() / 16, scale * 2**-10) + 1e-12
    assert ((back - x).abs() <= bound).all()
    nonzero = x.abs().amax(dim=1) > 0
    assert torch.equal(q.float().abs().amax(dim=1)[nonzero], torch.full((7,), FP8_MAX))
    assert torch.equal(back[3], torch.zeros(256))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_computes_its_dequantized_reference(bias, dtype):
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 48, bias=bias).to(dtype)
    layer = Fp8Linear.quantize(linear)
    x = torch.randn(2, 5, 64, dtype=dtype)
    y = layer(x)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    xq, xs = quantize_rows(x.reshape(-1, 64))
    expected = (xq.double() * xs.double()) @ (layer.weight.double() * layer.weight_scale.double().t()).t()
    if bias:
        expected = expected + linear.bias.double()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double().reshape(-1, 48), expected, rtol=tolerance, atol=tolerance)
    # ... and within FP8's precision of the layer it replaced
    exact = linear(x).double()
    assert (y.double() - exact).norm() / exact.norm() < 0.08


def test_layers_of_a_bad_kind_are_refused():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Linear(torch.zeros(16, 16), torch.ones(16), None)
    with pytest.raises(ValueError, match="weight scales"):
        Fp8Linear(torch.zeros(16, 16).to(FP8), torch.ones(8), None)


def test_a_steps_rows_choose_the_gemm_kernel_by_row_count_and_layer_shape():
    """Few rows to the few-row kernel, 33-128 to the swapped one, up to 256 the swapped one only for
    layers no wider than deep (the 8B shape's O and down projections), more to torch._scaled_mm."""
    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    for layer in (qkv, o, gate_up, down):
        assert [gemm_kernel(m, *layer) for m in (1, 32, 33, 64, 128)] == ["few_rows"] * 2 + ["swapped"] * 3
        assert gemm_kernel(257, *layer) == gemm_kernel(8192, *layer) == "scaled_mm"
    assert [gemm_kernel(256, *layer) for layer in (qkv, o, gate_up, down)] == [
        "scaled_mm", "swapped", "scaled_mm", "swapped"]
    assert gemm_kernel(129, *qkv) == "scaled_mm" and gemm_kernel(129, *o) == "swapped"


def test_the_warm_up_runs_no_gemm_for_layers_off_cuda():
    """`compile_gemm_variants` runs each CUDA layer shape at every Triton row count
    (test_gpu_fp8_gemm.py); a CPU model's layers take torch._scaled_mm's reference, which compiles
    nothing, so the engine's warm-up runs none of them."""
    model = _tiny()
    assert quantize_linears(model) > 0
    assert compile_gemm_variants(model) == 0


def _tiny(family: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_tiny_config(family, 1000)).eval()


def test_every_linear_but_the_output_embedding_is_quantized():
    model = _tiny()
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 60, bias=False)  # 60: no FP8 GEMM shape
    done = quantize_linears(model)
    layers = model.config.num_hidden_layers
    assert done == 7 * layers - 1  # q, k, v, o, gate, up, down per layer, but the one above
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert isinstance(model.model.layers[1].self_attn.q_proj, Fp8Linear)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert compute_dtype(model) == torch.float32
    assert quantize_linears(model) == 0  # nothing left in the model's dtype


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased Q/K/V
def test_fused_fp8_projections_equal_the_separate_ones(family):
    separate = _tiny(family)
    quantize_linears(separate)
    fused = copy.deepcopy(separate)
    assert fuse_projections(fused) == 2 * fused.config.num_hidden_layers  # FP8 layers fuse as FP8
    group = fused.model.layers[0].self_attn.q_k_v_fused
    assert isinstance(group, FusedLinear) and isinstance(group.linear, Fp8Linear)
    ids = torch.randint(0, 1000, (1, 23))
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, separate(input_ids=ids).logits)


@pytest.mark.parametrize(("loop", "compiled"), [("sync", False), ("async", False), ("sync", True)])
def test_engine_in_fp8_gives_generate_tokens_of_the_quantized_model(loop, compiled):
    model = _tiny()
    reference = copy.deepcopy(model)
    fuse_projections(reference)
    quantize_linears(reference)  # what the engine does to its model, in the same order
    # compiled: the FP8 GEMM op traced into the decode and prefill graphs (aot_eager: no codegen)
    core = make_core(model, fuse_projections=True, quantization="fp8", step_loop=loop,
                     max_num_batched_tokens=32, compile_backend="aot_eager" if compiled else None,
                     compile_prefill=compiled)
    mlp = model.model.layers[0].mlp  # the engine's FP8 gated MLP over the fused gate/up layer
    assert isinstance(mlp, Fp8GatedMLP) and isinstance(mlp.gate_up, Fp8Linear)
    prompts = [[(7 * i + j) % 1000 for j in range(n)] for i, n in enumerate([5, 40, 1, 17])]
    arrivals = [Arrival(f"r{i}", p, SamplingParams(max_tokens=12), i) for i, p in enumerate(prompts)]
    result = run(core, arrivals)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(reference, a.prompt_ids, 12, None), a.request_id


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization 'int4'"):
        make_core(_tiny(), quantization="int4")


def test_served_in_fp8_over_the_wire(serve, tiny_model_dir):
    server = serve("--quantization", "fp8")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    quantize_linears(model)  # on the CPU the server fuses no projections
    prompt = list(range(100, 120))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=10, ignore_eos=True))
        req.token_ids.ids.extend(prompt)
        tokens = [t for m in stub.GenerateStream(req, timeout=60) for t in m.token_ids]
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=60)
    assert tokens == hf_greedy(model, prompt, 10, None)
    assert info.dtype == "float32"  # what the model computes in; its linear layers hold e4m3
    assert "quantized 14 linear layers to FP8" in server.log.read_text()
