"""The FP8 format the engine stores and computes in: e4m3 (`float8_e4m3fn`), and the one rounding
every FP8 path shares, weights, activations and K/V alike: x / scale in float32, saturated to
e4m3's largest finite value, rounded to e4m3; read back as the stored value times the scale."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3 has no infinity, its largest finite value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) / scale (float32, a 0-d tensor or broadcastable) -> e4m3, saturated."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values * scale, computed in float32, -> `dtype`."""
    return (x.float() * scale).to(dtype)
