"""FP8 GEMM for the few rows of a decode step: a Triton kernel that streams the e4m3 weights once.

With few rows the GEMM reads its weights and little else, so its time is their bytes over the
memory bandwidth. cuBLASLt's and CUTLASS's row-wise scaled FP8 kernels are tiled for many rows
(docs/quantization.md measures them at few); here each program takes BLOCK_N output channels and
all the rows (BLOCK_M of them, padded to 16, the tensor cores' least), walks K in BLOCK_K steps,
and applies the row and channel scales once at the end: y = (x_q @ w_q^T) * x_scale * w_scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K] e4m3
    w_ptr,  # [N, K] e4m3
    x_scale_ptr,  # [M] float32
    w_scale_ptr,  # [N] float32
    out_ptr,  # [M, N]
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    k_first = tl.program_id(2) * k_per_split  # this program's share of K (all of it without split-K)
    k_end = tl.minimum(k_first + k_per_split, K)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_first, k_end, BLOCK_K):
        k = k0 + rk
        k_ok = k < k_end
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc)
    x_scale = tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    split_out = out_ptr + tl.program_id(2).to(tl.int64) * stride_os
    out = split_out + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# 64-row programs gave wrong products in the GPU tests (docs/quantization.md); 16 and 32 matched
MAX_BLOCK_M = 32


@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 4
    # programs along K per output tile: their float32 partial products are summed after (in a
    # fixed order: the same answer every run), so a narrow layer still has programs for every SM
    split_k: int = 1


def default_config(n: int) -> GemmConfig:
    """Wide outputs have programs enough with wider tiles (fewer, longer weight streams)."""
    return GemmConfig(block_n=64 if n >= 16384 else 32)


def fp8_gemm(
    x: torch.Tensor,  # [M, K] e4m3, rows contiguous
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3, rows contiguous
    weight_scale: torch.Tensor,  # [1, N] float32
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """-> [M, N] in `out_dtype`: (x @ weight^T) scaled per row of x and per row of weight."""
    config = config or default_config(weight.shape[0])
    m, k = x.shape
    n = weight.shape[0]
    split = config.split_k
    # each split's K share, whole BLOCK_K steps
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    if split > 1:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    # 16 or 32 rows a program (the tensor cores' least is 16); more rows take more programs
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m), split)
    _fp8_gemm_kernel[grid](
        x, weight, x_scale, weight_scale, out, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.warps, num_stages=config.stages,
    )
    return out.sum(0).to(out_dtype) if split > 1 else out
