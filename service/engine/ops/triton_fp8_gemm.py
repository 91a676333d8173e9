"""FP8 GEMM for the few rows of a decode step: a Triton kernel that streams the e4m3 weights once.

With few rows the GEMM reads its weights and little else, so its time is their bytes over the
memory bandwidth. cuBLASLt's and CUTLASS's row-wise scaled FP8 kernels are tiled for many rows
(docs/quantization.md measures them at few); here each program takes BLOCK_N output channels and
all the rows (BLOCK_M of them, padded to 16, the tensor cores' least), walks its share of K in
BLOCK_K steps, and applies the row and channel scales once at the end:
y = (x_q @ w_q^T) * x_scale * w_scale.

A layer of few output tiles splits K among programs (split-K) so that every SM streams: each split
stores its float32 partial product, and the last split of a tile to finish (a counter per tile)
sums the partials in split order and writes the output, in the same launch: no second kernel, and
the same answer whichever split finishes last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_and_store(acc, rm, rn, m_ok, n_ok, x_scale_ptr, w_scale_ptr, out_ptr, stride_om):
    w_scale = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    x_scale = tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_of_splits(acc, rm, rn, m_ok, n_ok, partial_ptr, arrivals_ptr, M, N, SPLIT_K: tl.constexpr):
    """Store this split's partial product; -> (the tile's sum, whether this program is the last of
    its splits to arrive: the one that holds the sum and writes the output)."""
    tile_ok = m_ok[:, None] & n_ok[None, :]
    partials = partial_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    plane = M * N
    tl.store(partials + tl.program_id(2) * plane, acc, mask=tile_ok)
    tl.debug_barrier()  # every thread's partial stored before the tile's counter moves
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:  # the other splits' partials are stored: add them all in split order
        for s in tl.static_range(SPLIT_K):  # the same sum whichever split is last
            total += tl.load(partials + s * plane, mask=tile_ok, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(arrivals_ptr + tile, 0)  # ready for the next launch
    return total, last


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K] e4m3
    w_ptr,  # [N, K] e4m3
    x_scale_ptr,  # [M] float32
    w_scale_ptr,  # [N] float32
    out_ptr,  # [M, N]
    partial_ptr,  # [SPLIT_K, M, N] float32 (split-K only)
    arrivals_ptr,  # one int32 per output tile, zero between launches (split-K only)
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
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
    if SPLIT_K == 1:
        _scale_and_store(acc, rm, rn, m_ok, n_ok, x_scale_ptr, w_scale_ptr, out_ptr, stride_om)
    else:
        total, last = _sum_of_splits(acc, rm, rn, m_ok, n_ok, partial_ptr, arrivals_ptr, M, N, SPLIT_K)
        if last:
            _scale_and_store(total, rm, rn, m_ok, n_ok, x_scale_ptr, w_scale_ptr, out_ptr, stride_om)


# 64-row programs gave wrong products in the GPU tests (docs/quantization.md); 16 and 32 matched
MAX_BLOCK_M = 32
MAX_SPLIT_K = 8


@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 4
    # programs along K per output tile, their float32 partial products summed by the last to finish
    split_k: int = 1


def default_config(n: int, k: int, sms: int) -> GemmConfig:
    """From `tandem bench fp8 --gemm`'s sweep of the 8B shape's layers (docs/quantization.md):
    narrow tiles for wide layers, long K steps for deep ones, and K split until the programs fill
    every SM twice over."""
    block_n = 32 if n >= 16384 else 64
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 2 * sms and split < 4 and k // (2 * split) >= 1024:
        split *= 2
    return GemmConfig(block_n=block_n, block_k=256 if k >= 8192 else 128, split_k=split)


_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_SMS: dict[torch.device, int] = {}


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's split-K counters: every launch leaves them at zero, and the launches that share
    them follow one another on the stream that runs the model's layers."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _ARRIVALS[device] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
    return counters


def _sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


@dataclass(frozen=True)
class Launch:
    """A split-K launch of an [M, N] output: its grid (N tiles, M tiles, splits), each split's share
    of K, and the float32 partials and per-tile counters the splits need (the output itself, unused,
    where K is not split)."""

    grid: tuple[int, int, int]
    k_per_split: int
    partials: torch.Tensor
    arrivals: torch.Tensor

    @classmethod
    def plan(cls, out: torch.Tensor, k: int, config: GemmConfig, block_m: int) -> Launch:
        m, n = out.shape
        # each split's K share, whole BLOCK_K steps (a split past K would have nothing to add)
        k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
        split = triton.cdiv(k, k_per_split)
        if split > MAX_SPLIT_K:
            raise ValueError(f"split_k {split} > {MAX_SPLIT_K}")
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m), split)
        if split == 1:
            return cls(grid, k_per_split, out, out)
        partials = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
        return cls(grid, k_per_split, partials, _arrivals(out.device, grid[0] * grid[1]))


def fp8_gemm(
    x: torch.Tensor,  # [M, K] e4m3, rows contiguous
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3, rows contiguous
    weight_scale: torch.Tensor,  # [1, N] float32
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """-> [M, N] in `out_dtype`: (x @ weight^T) scaled per row of x and per row of weight."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or default_config(n, k, _sms(x.device))
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    # 16 or 32 rows a program (the tensor cores' least is 16); more rows take more programs
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    launch = Launch.plan(out, k, config, block_m)
    _fp8_gemm_kernel[launch.grid](
        x, weight, x_scale, weight_scale, out, launch.partials, launch.arrivals,
        m, n, k, launch.k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=launch.grid[2],
        num_warps=config.warps, num_stages=config.stages,
    )
    return out
