"""FP8 K/V: how the cache's values are quantized on write and dequantized on read (torch side).

An FP8 cache stores e4m3 values with one float32 scale per layer for K and one for V, rounded as
e4m3.py rounds (stored = e4m3(clamp(x / scale, -448, 448)), read = stored * scale in float32, then
the model's dtype). Every
torch path (the CPU ops, the CUDA gathers) goes through these functions, and the Triton kernels do
the same arithmetic in the same order, so a value reads the same wherever it is read. A scale of 1.0
(vLLM's default for checkpoints without calibrated scales) keeps K/V as they are, within e4m3's
precision, for the magnitudes attention's K and V usually have.

The data-movement ops (index_copy_ in particular) have no float8 kernel on every device, so the
cache's bytes move as uint8 (`as_bytes`): a copy of bytes is the copy of the values.
"""

from __future__ import annotations

import torch

from .e4m3 import FP8, FP8_MAX, dequantize, is_fp8, quantize  # noqa: F401 (re-exported)

KV_CACHE_DTYPES = ("auto", "fp8")


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of `kv_cache_dtype` stores: "auto" = the model's, "fp8" = e4m3."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8
    raise ValueError(f"KV-cache dtype {kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")


def layer_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, layer: int
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One layer's K and V scales as 0-d views of the cache's [layers] tensors (the kernels read
    them where they lie); None for a cache in the model's dtype."""
    if k_scale is None or v_scale is None:
        return None
    return k_scale[layer], v_scale[layer]


def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as an FP8 cache would give it back, in x's dtype: what attention over the cache reads."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8 (same strides, no copy) for copies and index ops; any other as is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def select(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index), an FP8 cache's as bytes (its values unchanged)."""
    if not is_fp8(cache.dtype):
        return cache.index_select(0, index)
    return as_bytes(cache).index_select(0, index).view(cache.dtype)


def read(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as attention reads them: dequantized to `dtype` where the cache is FP8 (`scale`
    given), the rows themselves otherwise."""
    return rows if scale is None else dequantize(rows, scale, dtype)


def write(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None) -> None:
    """values [n, ...] into cache rows `slots` ([slots, ...] view of one layer): quantized where
    the cache is FP8 (`scale` given), cast to the cache's dtype otherwise."""
    if scale is None:
        cache.index_copy_(0, slots, values.to(cache.dtype))
    else:
        as_bytes(cache).index_copy_(0, slots, as_bytes(quantize(values, scale)))
