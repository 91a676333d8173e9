"""The rotary embedding's cos and sin inside a Triton kernel, shared by the kernels that rotate Q
and K as they load them (the decode kernel and the step's K/V write; deferred_rotary.py says when
the model leaves the rotation to them)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotary_cos_sin(inv_freq_ptr, rope_scaling, pos, d, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """cos and sin of each dimension at `pos` as transformers computes them (fp32 angle, rounded to
    the model's dtype), and rotate-half's partner dimension and sign: x * cos + sign * x[pair] * sin."""
    half: tl.constexpr = HEAD_DIM // 2
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + d % half)
    cos = (tl.cos(angle) * rope_scaling).to(DTYPE).to(tl.float32)
    sin = (tl.sin(angle) * rope_scaling).to(DTYPE).to(tl.float32)
    pair = (d + half) % HEAD_DIM
    sign = tl.where(d < half, -1.0, 1.0)
    return cos, sin, pair, sign
