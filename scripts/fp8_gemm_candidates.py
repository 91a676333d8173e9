"""Which kernel a decode step's few-row FP8 GEMM should run (docs/quantization.md, "FP8 linear layers").

Each 8B layer's GEMM at 1, 4, 16 and 32 rows, timed as a decode step runs it (in a CUDA graph, each
call reading another copy of the weights, so none comes warm from the L2), against bf16 (cuBLAS):

- `w8a8`: the engine's kernel (triton_fp8_gemm.py: e4m3 activations and weights on the tensor
  cores), at its default configuration and at the best of a sweep;
- `w8a16`: the same tiles with the activations left in bf16 and the weights widened to bf16 in the
  kernel (no activation quantization; twice the tensor-core work, and a conversion per weight);
- `gemv` (up to 4 rows): no tensor cores, each weight widened to float32 and multiplied on the
  CUDA cores.
- `torch._scaled_mm` row-wise (CUTLASS).
- `tiled` (from 64 rows): the usual 2-D tiles, 64 or 128 rows a program.
- `swapped` (from 64 rows; the engine's from 33 rows, triton_fp8_gemm_swapped.py): the product
  taken as W . X^T, the layer's output channels on the tensor cores' wide side and the rows on their
  narrow side, so that a step of 64-256 rows gets as many programs as a narrow layer has strips of
  output channels (cuBLASLt's 128 x 128 tiles give the 8B shape's O and down projections 64
  programs for 132 SMs at 256 rows: docs/quantization.md).

CUDA only: `python scripts/fp8_gemm_candidates.py [--rows 1,4,16,32] [--out gemm.json]`;
`--accuracy --rows 64,256`: each kernel's product against the exact one, and the swapped kernel with
its FP8 accumulation promoted to float32 every 32 or 128 products.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from tandem.service.engine.ops.fp8_linear import quantize_rows
from tandem.service.engine.ops.triton_fp8_gemm import (
    GemmConfig,
    Launch,
    _scale_and_store,
    _sum_of_splits,
    default_config,
    fp8_gemm,
)
from tandem.service.engine.ops.triton_fp8_gemm_swapped import SwappedConfig, fp8_gemm_swapped

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, ones_ptr, w_scale_ptr, out_ptr, partial_ptr, arrivals_ptr, M, N, K,
                  k_per_split, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GEMV: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    k_first = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_first + k_per_split, K)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K) if GEMV else (1, 1, 1), dtype=tl.float32)
    for k0 in tl.range(k_first, k_end, BLOCK_K):
        k = k0 + rk
        k_ok = k < k_end
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if GEMV:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        else:  # [BLOCK_K, BLOCK_N], as the engine's kernel loads it
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(x, w.to(x.dtype), acc)
    if GEMV:
        acc = tl.sum(acc3, axis=2)
    if SPLIT_K == 1:
        _scale_and_store(acc, rm, rn, m_ok, n_ok, ones_ptr, w_scale_ptr, out_ptr, stride_om)
    else:
        total, last = _sum_of_splits(acc, rm, rn, m_ok, n_ok, partial_ptr, arrivals_ptr, M, N, SPLIT_K)
        if last:
            _scale_and_store(total, rm, rn, m_ok, n_ok, ones_ptr, w_scale_ptr, out_ptr, stride_om)


@triton.jit
def _tiled_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out tile [BLOCK_M, BLOCK_N] = X tile . W tile^T with 64-128 rows a program (the engine's kernel
    takes at most 32): the usual 2-D tiling, the rows on the tensor cores' wide side."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    acc = acc * tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)[:, None]
    acc = acc * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


TILED_CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages); BLOCK_K 128
    (bm, bn, w, st) for bm, bn, w, st in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]


def tiled(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
          config: tuple[int, int, int, int], out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    block_m, block_n, warps, stages = config
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    _tiled_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        xq, weight, xs, weight_scale, out, m, n, k, xq.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=stages)
    return out


SWAPPED_CONFIGS = [  # (BLOCK_N, BLOCK_K, warps, stages); BLOCK_M follows the rows, up to 128
    (bn, bk, w, st) for bn, bk, w, st in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))]


def swapped(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            config: tuple[int, int, int, int], out_dtype: torch.dtype = torch.bfloat16,
            imprecise: int | None = None) -> torch.Tensor:
    """The engine's swapped kernel (triton_fp8_gemm_swapped.py) at `config`, (BLOCK_N, BLOCK_K, warps,
    stages); `imprecise`: Triton's max_num_imprecise_acc (None: Triton's default)."""
    return fp8_gemm_swapped(xq, xs, weight, weight_scale, out_dtype, SwappedConfig(*config, imprecise))


def accuracy(rows: list[int]) -> dict:
    """Each kernel's product against the exact one (float64 over the same e4m3 operands and scales), as
    a relative norm, and the swapped kernel's time, with Triton's FP8 accumulation as it defaults and
    promoted into float32 every 32 or 128 products."""
    result: dict = {}
    config = (64, 256, 4, 4)
    for name, (n, k) in LAYERS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, n).contiguous()
        copies = max(2, -(-4 * 2**30 // (8 * n * k)))
        fp8_weights = [wq.clone() for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            exact = (xq.double() * xs.double()) @ (wq.double() * ws.double().t()).t()

            def error(got: torch.Tensor, exact=exact) -> float:
                return ((got.double() - exact).norm() / exact.norm()).item()

            row = {"scaled_mm_rowwise": error(torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                               out_dtype=torch.float32)),
                   "engine_kernel": error(fp8_gemm(xq, xs, wq, ws, torch.float32))}
            for imprecise in (None, 128, 32):
                key = f"swapped_imprecise_{imprecise}"
                row[key] = error(swapped(xq, xs, wq, ws, config, torch.float32, imprecise))

                def calls(q=(xq, xs, ws), imprecise=imprecise, weights=fp8_weights) -> None:
                    for weight in weights:
                        swapped(q[0], q[1], weight, q[2], config, imprecise=imprecise)
                row[f"{key}_us"] = round(1e3 * do_bench_cudagraph(calls, rep=30, return_mode="median")
                                         / len(fp8_weights), 2)
            result[f"{name} {n}x{k}, {m} rows"] = row
            print(f"{name} {n}x{k}, {m:3d} rows: " + ", ".join(f"{key} {v:.3g}" for key, v in row.items()),
                  flush=True)
    return result


def w8a16(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, config: GemmConfig,
          gemv: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ (weight [N, K] e4m3 * weight_scale [1, N])^T -> [M, N] bf16."""
    m, k = x.shape
    n = weight.shape[0]
    block_m = triton.next_power_of_2(m) if gemv else min(32, max(16, triton.next_power_of_2(m)))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = Launch.plan(out, k, config, block_m)
    ones = torch.ones(m, dtype=torch.float32, device=x.device)
    _w8a16_kernel[launch.grid](x, weight, ones, weight_scale, out, launch.partials, launch.arrivals, m, n, k,
                               launch.k_per_split, x.stride(0), weight.stride(0), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                               SPLIT_K=launch.grid[2], GEMV=gemv, num_warps=config.warps,
                               num_stages=config.stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--accuracy", action="store_true",
                    help="each kernel's distance from the exact product; the swapped kernel's accumulation")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.accuracy:
        result = {"gpu": torch.cuda.get_device_name(),
                  "accuracy": accuracy([int(r) for r in a.rows.split(",")])}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [GemmConfig(bn, bk, 4, 4, sk)
               for bn, bk, sk in itertools.product((32, 64), (128, 256), (1, 2, 4))]
    result: dict = {"gpu": torch.cuda.get_device_name(), "layers": {}}
    for name, (n, k) in LAYERS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, n).contiguous()
        copies = max(2, -(-4 * 2**30 // (8 * n * k)))
        bf16_weights, fp8_weights = [w.clone() for _ in range(copies)], [wq.clone() for _ in range(copies)]

        def us(gemm: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
            def calls() -> None:
                for weight in weights:
                    gemm(weight)
            return round(1e3 * do_bench_cudagraph(calls, rep=30, return_mode="median") / len(weights), 2)

        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            reference = x.float() @ (wq.float() * ws.t()).t()
            # the tensor-core kernels' products, e4m3 x e4m3 and bf16 x widened e4m3: near the reference
            for got in (fp8_gemm(xq, xs, wq, ws, torch.float32), w8a16(x, wq, ws, configs[0]).float()):
                assert ((got - reference).norm() / reference.norm()).item() < 0.1
            def w8a8(weight: torch.Tensor, c: GemmConfig | None = None, q=(xq, xs, ws)) -> torch.Tensor:
                return fp8_gemm(q[0], q[1], weight, q[2], torch.bfloat16, c)

            def widened(c: GemmConfig, gemv: bool = False, x=x, ws=ws) -> Callable[[torch.Tensor], object]:
                return lambda weight: w8a16(x, weight, ws, c, gemv)

            row = {
                "bf16": us(lambda weight, x=x: torch.nn.functional.linear(x, weight), bf16_weights),
                "scaled_mm_rowwise": us(lambda weight, q=(xq, xs, ws): torch._scaled_mm(
                    q[0], weight.t(), scale_a=q[1], scale_b=q[2], out_dtype=torch.bfloat16), fp8_weights),
                "w8a8_default": us(w8a8, fp8_weights),
                "w8a8_best": min(us(lambda weight, c=c: w8a8(weight, c), fp8_weights) for c in configs),
            }
            if m <= 32:  # widening the weights only pays where the activations are few
                row["w8a16_best"] = min(us(widened(c), fp8_weights) for c in configs)
            if m <= 4:
                row["gemv_best"] = min(us(widened(c, gemv=True), fp8_weights)
                                       for c in configs if c.block_k == 128)
            if m >= 64:
                # against the engine's own kernel on the same operands: the same sums in other orders,
                # unless Hopper's FP8 accumulation (wgmma) keeps fewer bits: recorded, not assumed; a
                # configuration whose product is wrong is recorded as such and not timed
                same = fp8_gemm(xq, xs, wq, ws, torch.float32)
                for kind, kernel, candidates in (("swapped", swapped, SWAPPED_CONFIGS),
                                                  ("tiled", tiled, TILED_CONFIGS)):
                    times, wrong, worst = {}, [], 0.0
                    for c in candidates:
                        try:
                            got = kernel(xq, xs, wq, ws, c, torch.float32)
                            diff = ((got - same).norm() / same.norm()).item()
                        except Exception as exc:  # a configuration the compiler rejects
                            wrong.append(f"{c}: {str(exc)[:80]}")
                            continue
                        if not diff < 0.01:
                            wrong.append(f"{c}: {diff:.3g}")
                            continue
                        worst = max(worst, diff)
                        def call(weight: torch.Tensor, c=c, q=(xq, xs, ws), f=kernel) -> torch.Tensor:
                            return f(q[0], q[1], weight, q[2], c)

                        times[c] = us(call, fp8_weights)
                    if times:
                        best = min(times, key=times.get)
                        row[f"{kind}_best"], row[f"{kind}_best_configuration"] = times[best], str(best)
                    row[f"{kind}_vs_engine"] = worst
                    if wrong:
                        row[f"{kind}_wrong"] = wrong
            row["default_configuration"] = str(default_config(n, k, sms))
            result["layers"][f"{name} {n}x{k}, {m} rows"] = row
            print(f"{name} {n}x{k}, {m:2d} rows: " + ", ".join(f"{key} {v}" for key, v in row.items()),
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
