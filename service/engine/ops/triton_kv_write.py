"""A step's new K/V written into the paged cache by one Triton kernel, Q and K rotated on the way.

A step with prompt chunks wrote its K and V with two `index_copy_` calls per layer, each reading
the model's strided views one element at a time, after the compiled model had rotated Q and K in
an element-wise kernel that computed cos and sin again for every head (both far from the memory
bandwidth: docs/benchmarks.md). Here one program per token loads the token's heads once, rotates
Q and K where the model leaves the rotary embedding to the attention ops (deferred_rotary.py) with
cos and sin computed once for all heads, writes K and V to the token's cache slot, and the rotated
Q packed [T, H, D], the layout the prompt chunks' flash attention and the decode rows read (and,
for prompt chunks attended one by one, the rotated K). An FP8 cache (KV_FP8) gets K and V
quantized with the layer's scales (kv_quant.py); the rotated K handed back stays in the model's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .deferred_rotary import DeferredRotary
from .kv_quant import is_fp8
from .triton_fp8 import quantize
from .triton_rotary import rotary_cos_sin


# an FP8 cache's scales: one layer's is a 4-byte step into the [layers] tensor (no alignment to
# specialize on: one variant for every layer)
@triton.jit(do_not_specialize_on_alignment=["k_scale_ptr", "v_scale_ptr"])
def _write_step_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    pos_ptr,
    inv_freq_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    rope_scaling,
    heads,
    kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kot,
    stride_koh,
    stride_cs,
    stride_ch,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    KEYS_OUT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    hk = tl.arange(0, KV_HEADS_PAD)
    kv_ok = (hk < kv_heads)[:, None]
    k_rows = k_ptr + t * stride_kt + hk[:, None] * stride_kh
    k = tl.load(k_rows + d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :], mask=kv_ok, other=0.0)
    if ROTARY:  # the token's cos and sin once, for Q's heads and K's
        dtype = q_ptr.dtype.element_ty
        pos = tl.load(pos_ptr + t)
        cos, sin, pair, sign = rotary_cos_sin(inv_freq_ptr, rope_scaling, pos, d, HEAD_DIM, dtype)
        k_pair = tl.load(k_rows + pair[None, :], mask=kv_ok, other=0.0)
        k = (k.to(tl.float32) * cos + sign * k_pair.to(tl.float32) * sin).to(dtype)  # rounded as the model's
        if KEYS_OUT:
            tl.store(k_out_ptr + t * stride_kot + hk[:, None] * stride_koh + d[None, :], k, mask=kv_ok)
        h = tl.arange(0, HEADS_PAD)
        q_ok = (h < heads)[:, None]
        q_rows = q_ptr + t * stride_qt + h[:, None] * stride_qh
        q = tl.load(q_rows + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q_pair = tl.load(q_rows + pair[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q = (q * cos + sign * q_pair * sin).to(dtype)
        tl.store(q_out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], q, mask=q_ok)
    # 64-bit: a head-major cache's head stride times the heads may pass 2**31 elements
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cache_off = slot * stride_cs + hk[:, None].to(tl.int64) * stride_ch + d[None, :]
    if KV_FP8:
        tl.store(k_cache_ptr + cache_off, quantize(k, tl.load(k_scale_ptr), k_cache_ptr.dtype.element_ty),
                 mask=kv_ok)
        tl.store(v_cache_ptr + cache_off, quantize(v, tl.load(v_scale_ptr), v_cache_ptr.dtype.element_ty),
                 mask=kv_ok)
    else:
        tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
        tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)


def write_step_kv(
    q: torch.Tensor,  # [T, H, D], any strides with unit stride in D
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D] (a transposed view over a head-major cache)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] each token's cache slot
    positions: torch.Tensor | None,  # [T] each token's position; with `rotary` only
    rotary: DeferredRotary | None,
    keys: bool = False,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write each token's K (rotated, with `rotary`) and V to its cache slot -> (the queries: rotated
    and packed [T, H, D] with `rotary`, else `q` itself; the keys as stored, where `keys` asks for
    them: packed [T, Hkv, D] with `rotary`, else `k` itself; otherwise None). `kv_scales` =
    (k_scale, v_scale), 0-d float32 tensors: the caches are FP8 and K/V are quantized with them
    (the keys handed back are not: they are the model's, as the step computed them)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    fp8 = kv_scales is not None
    assert fp8 == is_fp8(k_cache.dtype) == is_fp8(v_cache.dtype), "an FP8 cache comes with its scales"
    q_out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device) if rotary is not None else q
    keys_out = rotary is not None and keys
    k_out = torch.empty(tokens, kv_heads, head_dim, dtype=k.dtype, device=k.device) if keys_out else k
    if tokens == 0:
        return q_out, k_out if keys else None
    _write_step_kv_kernel[(tokens,)](
        q,
        k,
        v,
        slot_mapping,
        positions if rotary is not None else slot_mapping,  # unused pointers without rotary
        rotary.inv_freq if rotary is not None else slot_mapping,
        q_out,
        k_out,
        k_cache,
        v_cache,
        *(kv_scales if fp8 else (slot_mapping, slot_mapping)),  # unused pointers without FP8
        rotary.scaling if rotary is not None else 1.0,
        heads,
        kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        ROTARY=rotary is not None,
        KEYS_OUT=keys_out,
        KV_FP8=fp8,
        num_warps=8 if triton.next_power_of_2(heads) * head_dim > 4096 else 4,
    )
    return q_out, k_out if keys else None
