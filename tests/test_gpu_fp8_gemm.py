"""The FP8 GEMMs of a decode step's rows (Triton: the few-row and the swapped kernel) and the
scaled-GEMM op's choice of kernel, against float32 references on the same e4m3 operands (on a GPU:
-m gpu)."""

from __future__ import annotations

import pytest
import torch

from tandem.service.engine.ops.fp8_linear import SMALL_ROWS, Fp8Linear, gemm_kernel, quantize_rows, scaled_mm

pytestmark = pytest.mark.gpu


def _operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    return xq, xs, wq, ws.reshape(1, n).contiguous()


def _reference(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return (xq.float() * xs) @ (wq.float() * ws.t()).t()


# (block_n, block_k, warps, stages[, split_k]); None: the layer's default (split-K for the narrow ones)
CONFIGS = [None, (16, 128, 4, 3), (128, 128, 8, 4), (32, 256, 4, 4, 2), (64, 128, 4, 4, 4),
           (32, 128, 4, 4, 8)]


@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 64])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (48, 272), (28672, 4096)])
@pytest.mark.parametrize("config", CONFIGS)
def test_small_row_kernel_matches_reference(m, n, k, config):
    from tandem.service.engine.ops.triton_fp8_gemm import GemmConfig, fp8_gemm  # Triton: CUDA hosts only

    config = GemmConfig(*config) if config else None
    xq, xs, wq, ws = _operands(m, n, k)
    got = fp8_gemm(xq, xs, wq, ws, torch.float32, config)
    expected = _reference(xq, xs, wq, ws)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3 * expected.abs().max().item())
    assert fp8_gemm(xq, xs, wq, ws, torch.bfloat16, config).dtype == torch.bfloat16


@pytest.mark.parametrize("split_k", [2, 4, 8])
def test_split_k_gives_the_same_bits_every_launch(split_k):
    """The last split of a tile to finish sums the partials in split order: the same output bits
    whatever order the splits finish in, launch after launch (the tile counters back at zero)."""
    from tandem.service.engine.ops.triton_fp8_gemm import GemmConfig, fp8_gemm

    xq, xs, wq, ws = _operands(5, 4096, 14336)
    config = GemmConfig(64, 256, 4, 4, split_k)
    first = fp8_gemm(xq, xs, wq, ws, torch.float32, config)
    for _ in range(20):
        assert torch.equal(fp8_gemm(xq, xs, wq, ws, torch.float32, config), first)
    expected = _reference(xq, xs, wq, ws)
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-3 * expected.abs().max().item())


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


# The swapped kernel's programs are the size of Hopper's FP8 wgmma, which adds products in an
# accumulator of fewer bits than float32 until Triton promotes them (max_num_imprecise_acc):
# its distance from the float32 product, as a share of the product's norm (docs/quantization.md
# measures it; a wrong mask, index or scale is off by tens of percent)
SWAPPED_ERROR = {None: 5e-3, 128: 5e-4, 32: 2e-4}
# (block_n, block_k, warps, stages, imprecise_acc); None: the engine's default
SWAPPED_CONFIGS = [None, (128, 128, 8, 4, None), (64, 128, 4, 3, None), (64, 256, 4, 4, 128),
                   (64, 256, 4, 4, 32)]


@pytest.mark.parametrize("m", [33, 64, 100, 128, 129, 256])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (48, 272), (28672, 4096)])
@pytest.mark.parametrize("config", SWAPPED_CONFIGS)
def test_swapped_kernel_matches_reference(m, n, k, config):
    from tandem.service.engine.ops.triton_fp8_gemm_swapped import SwappedConfig, fp8_gemm_swapped

    config = SwappedConfig(*config) if config else SwappedConfig()
    xq, xs, wq, ws = _operands(m, n, k)
    got = fp8_gemm_swapped(xq, xs, wq, ws, torch.float32, config)
    assert _relative_error(got, _reference(xq, xs, wq, ws)) < SWAPPED_ERROR[config.imprecise_acc]
    assert fp8_gemm_swapped(xq, xs, wq, ws, torch.bfloat16, config).dtype == torch.bfloat16


@pytest.mark.parametrize("m", [1, SMALL_ROWS, SMALL_ROWS + 1, 128, 129, 256, 257, 300])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (6144, 4096)])
def test_op_gives_the_same_product_either_side_of_its_kernel_choices(m, n, k):
    from tandem.service.engine.ops.triton_fp8_gemm_swapped import SwappedConfig

    xq, xs, wq, ws = _operands(m, n, k)
    got = scaled_mm(xq, xs, wq, ws, torch.float32)
    expected = _reference(xq, xs, wq, ws)
    if gemm_kernel(m, n, k) == "swapped":
        assert _relative_error(got, expected) < SWAPPED_ERROR[SwappedConfig().imprecise_acc]
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("m", [8, 64])  # the few-row kernel, the swapped one
def test_layer_in_a_compiled_graph_and_a_cuda_graph(m):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.quantize(lin)
    compiled = torch.compile(layer, dynamic=False)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    torch.testing.assert_close(compiled(x), eager, rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    static = x.clone()
    compiled(static)  # warm
    with torch.cuda.graph(graph):
        out = compiled(static)
    for _ in range(3):  # each replay's split-K counters left at zero for the next
        static.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, layer(static), rtol=2e-2, atol=2e-2)


def test_the_warm_up_compiles_every_variant_a_step_may_launch():
    """`compile_gemm_variants` (the engine's warm-up): afterwards the FP8 layers at any row count, up
    to past the Triton kernels' last, compile no Triton variant (an eager mixed step may bring any
    row count; one compiled while serving is a step that waits for the compiler)."""
    from torch import nn

    from tandem.service.engine.ops.fp8_linear import SWAPPED_NARROW_ROWS, compile_gemm_variants
    from tandem.service.engine.ops.triton_variants import compiled_variants

    def layer(n: int, k: int) -> Fp8Linear:
        return Fp8Linear.quantize(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))

    # a wide layer (n > k: the swapped kernel up to 128 rows) and a narrow one (up to 256)
    model = nn.Sequential(nn.Embedding(8, 256, device="cuda", dtype=torch.bfloat16), layer(512, 256),
                          layer(256, 512))
    assert compile_gemm_variants(model) == 128 + 256
    before = compiled_variants()
    for linear in model[1:]:
        for rows in range(1, SWAPPED_NARROW_ROWS + 2):
            linear(torch.randn(rows, linear.in_features, device="cuda", dtype=torch.bfloat16))
    assert compiled_variants() == before

