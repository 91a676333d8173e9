"""SiLU(gate) * up, quantized per row to e4m3, in one Triton kernel (fp8_mlp.silu_mul_quant).

Each program takes one row whole (gate and up, up to fp8_mlp.MAX_KERNEL_WIDTH values each): one
read of the fused gate/up projection's output, the row's largest magnitude from registers, one
write of the e4m3 row and its scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .e4m3 import FP8, FP8_MAX
from .fp8_linear import MIN_SCALE


@triton.jit
def _silu_mul_quant_kernel(gate_up_ptr, out_ptr, scale_ptr, width, stride_gm, stride_om,
                           FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    dtype = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_gm + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gm + width + cols, mask=ok, other=0.0).to(tl.float32)
    # the activation and the product each rounded to the model's dtype, as its modules round them
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    y = (act * up).to(dtype).to(tl.float32)
    amax = tl.max(tl.abs(y), axis=0)
    # quantize_rows: scale = max(amax / FP8_MAX, MIN_SCALE), rounded as IEEE's division; each value
    # times the scale's reciprocal (a row's divisions kept one program of a few rows busy for
    # microseconds; the product is within an ulp of the quotient)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    q = tl.clamp(y * tl.math.div_rn(1.0, scale), -FP8_MAX, FP8_MAX)
    tl.store(out_ptr + row * stride_om + cols, q.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def silu_mul_quant_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] -> (e4m3 [M, I], float32 scales [M, 1])."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=FP8, device=gate_up.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    if rows == 0:
        return out, scale
    block = triton.next_power_of_2(width)
    _silu_mul_quant_kernel[(rows,)](
        gate_up, out, scale, width, gate_up.stride(0), out.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block,
        num_warps=max(4, min(32, block // 1024)),
    )
    return out, scale
