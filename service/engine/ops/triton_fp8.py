"""FP8 K/V inside a Triton kernel: the arithmetic of kv_quant.py, shared by the kernels that write
the cache (the decode kernel and the step's K/V write) and the one that reads it (the decode kernel)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize(x, scale, FP8_DTYPE: tl.constexpr):
    """x / scale in float32, saturated to e4m3's range, rounded to e4m3 (kv_quant.quantize). The
    division rounds as IEEE's (torch's) does: Triton's `/` is an approximate division, which puts a
    float32 value next to an e4m3 rounding boundary on the other side of it now and then."""
    return tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0).to(FP8_DTYPE)


@triton.jit
def dequantize(x, scale, DTYPE: tl.constexpr):
    """e4m3 values times scale in float32, rounded to `DTYPE` (kv_quant.dequantize)."""
    return (x.to(tl.float32) * scale).to(DTYPE)
