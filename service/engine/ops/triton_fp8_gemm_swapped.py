"""FP8 GEMM for a decode step of 33-256 rows: the product taken as W . X^T (Triton).

cuBLASLt's row-wise scaled FP8 GEMM tiles the output 128 x 128: a step of 64-256 rows then gets
one or two row tiles, and a layer of 4,096 output channels 32-64 programs for the H100's 132 SMs.
Here each program takes BLOCK_N output channels on the tensor cores' wide side and all the step's
rows (up to BLOCK_M_MAX) on their narrow side: both operands are K-contiguous as they lie (the
weights [N, K], the rows [M, K]), the program walks K in BLOCK_K steps and scales its tile once at
the end, out^T = (w_q . x_q^T) * w_scale * x_scale. docs/quantization.md measures it against
`torch._scaled_mm` and the few-row kernel (triton_fp8_gemm.py) layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_swapped_kernel(
    x_ptr,  # [M, K] e4m3
    w_ptr,  # [N, K] e4m3
    x_scale_ptr,  # [M] float32
    w_scale_ptr,  # [N] float32
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_ACC)
    acc = acc * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)[:, None]
    acc = acc * tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)[None, :]
    out = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# a program's rows: more take more programs (4 stages of 64 channels and 128 rows, 256 deep, fill
# 192 KiB of an H100 SM's 227 KiB of shared memory)
BLOCK_M_MAX = 128


@dataclass(frozen=True)
class SwappedConfig:
    """The best of `scripts/fp8_gemm_candidates.py`'s sweep on every 8B layer at 64 rows and on the
    narrow ones at 256 (docs/quantization.md)."""

    block_n: int = 64
    block_k: int = 256
    warps: int = 4
    stages: int = 4
    # Triton's max_num_imprecise_acc: products a Hopper FP8 MMA adds in its own accumulator before
    # they go into float32. None (Triton's default, never promoted): promoting every 128 is as exact
    # as torch._scaled_mm and no faster than it; unpromoted the product is 0.13-0.29% of its norm
    # off, beside the operands' own 3.7% (docs/quantization.md, "How exact the swapped kernel is")
    imprecise_acc: int | None = None


def fp8_gemm_swapped(
    x: torch.Tensor,  # [M, K] e4m3, rows contiguous
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3, rows contiguous
    weight_scale: torch.Tensor,  # [1, N] float32
    out_dtype: torch.dtype,
    config: SwappedConfig | None = None,
) -> torch.Tensor:
    """-> [M, N] in `out_dtype`: (x @ weight^T) scaled per row of x and per row of weight."""
    config = config or SwappedConfig()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    block_m = min(BLOCK_M_MAX, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
    _fp8_gemm_swapped_kernel[grid](
        x, weight, x_scale, weight_scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=config.block_n, BLOCK_M=block_m, BLOCK_K=config.block_k,
        IMPRECISE_ACC=config.imprecise_acc, num_warps=config.warps, num_stages=config.stages,
    )
    return out
