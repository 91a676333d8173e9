"""The FP8 GEMM kernels of a decode step's rows (the few-row and the swapped one) on Triton's CPU
interpreter, in float32 (the interpreter's bf16 products are wrong: test_fp8_kv_cache.py says so):
quantized rows times e4m3 weights, with and without split-K, against float32 references on the
same e4m3 operands. `make test` runs this file with TRITON_INTERPRET=1; test_gpu_fp8_gemm.py covers
the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.service.engine.ops.fp8_linear import quantize_rows


@pytest.fixture(autouse=True)
def _interpreted() -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 (Triton reads it when it is first imported)")


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    wq, ws = quantize_rows(torch.randn(n, k) / 32)
    return wq, ws.reshape(1, n).contiguous()


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("m", [1, 5])
def test_quantized_rows_times_e4m3_weights(m, split_k):
    from tandem.service.engine.ops.triton_fp8_gemm import GemmConfig, fp8_gemm

    torch.manual_seed(m + split_k)
    wq, ws = _weights(48, 512)
    xq, xs = quantize_rows(torch.randn(m, 512))
    got = fp8_gemm(xq, xs, wq, ws, torch.float32, GemmConfig(16, 128, 4, 1, split_k))
    expected = (xq.float() * xs) @ (wq.float() * ws.t()).t()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_scale_forgotten_would_show():
    """The output is scaled by the rows' scales and the weights' (each differing per row), not left
    unscaled or scaled by one of them."""
    from tandem.service.engine.ops.triton_fp8_gemm import GemmConfig, fp8_gemm

    wq, ws = _weights(32, 256)
    xq, xs = quantize_rows(torch.randn(3, 256) * torch.tensor([[0.1], [1.0], [10.0]]))
    got = fp8_gemm(xq, xs, wq, ws, torch.float32, GemmConfig(16, 128, 4, 1, 1))
    unscaled = xq.float() @ wq.float().t()
    for wrong in (unscaled, unscaled * xs, unscaled * ws):
        assert not torch.allclose(got, wrong, rtol=1e-2)
    torch.testing.assert_close(got, unscaled * xs * ws, rtol=1e-5, atol=1e-5 * unscaled.abs().max().item())


@pytest.mark.parametrize("m", [33, 130])
def test_swapped_kernel_takes_rows_times_e4m3_weights(m):
    """W . X^T, its output stored back as [rows, channels]; 130 rows take two row programs, 40 channels
    a partial strip of 16, 272 a partial K step: every mask at work."""
    from tandem.service.engine.ops.triton_fp8_gemm_swapped import SwappedConfig, fp8_gemm_swapped

    torch.manual_seed(m)
    wq, ws = _weights(40, 272)
    xq, xs = quantize_rows(torch.randn(m, 272) * torch.linspace(0.1, 10.0, m)[:, None])
    got = fp8_gemm_swapped(xq, xs, wq, ws, torch.float32, SwappedConfig(16, 128, 4, 1))
    assert got.shape == (m, 40)
    expected = (xq.float() * xs) @ (wq.float() * ws.t()).t()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
