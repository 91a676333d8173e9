"""Plain-torch attention math: the CPU path and the reference the CUDA kernel is tested against."""

from __future__ import annotations

import torch

from .kv_quant import read, select


def causal_mask(
    q_pos: torch.Tensor, ctx_len: int, sliding_window: int | None, device: torch.device | None = None
) -> torch.Tensor:
    """[..., q, L] True where key position <= query position (and inside the window)."""
    k_pos = torch.arange(ctx_len, device=device or q_pos.device)
    mask = k_pos <= q_pos.unsqueeze(-1)
    if sliding_window:
        mask &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    return mask


def decode_mask(ctx_lens: torch.Tensor, width: int, sliding_window: int | None) -> torch.Tensor:
    """[B, width] keys each decode query (at position len - 1) attends to."""
    return causal_mask(ctx_lens - 1, width, sliding_window)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """One query per sequence: q [B, H, D], k/v [B, L, Hkv, D], mask [B, L] -> [B, H, D].

    Grouped-query heads share their K/V through a reshape (no copy of K/V per query head), and
    two batched matmuls replace a fused kernel whose per-call planning would dominate small steps.
    """
    b, h, d = q.shape
    kv_heads = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, kv_heads, h // kv_heads, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(b, h, d)


def fp8_products_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       qk: bool, pv: bool, step: float = 2**-4) -> torch.Tensor:
    """How far decode attention with e4m3 operands in its products may fall from
    `decode_attention`'s, per output element ([B, H, D]; the arguments as there, K/V dequantized).
    The query rounded to e4m3 (`qk`: each value within `step` of itself) moves each score by at most
    d = step * sum |q| |k| * scale, so each probability's share by a factor within e^(+-2d); each
    probability rounded to e4m3 (`pv`: within `step` of itself, or step / 64 / 448 of the largest
    in e4m3's subnormal range) moves the output by that share of each |v|."""
    b, h, d = q.shape
    kv_heads = k.shape[2]
    weighted = decode_attention(q, k, v.abs(), mask, scale)  # each output's sum of shares times |v|
    grow = torch.ones(b, h, 1, dtype=weighted.dtype, device=weighted.device)
    if qk:
        qg = q.abs().reshape(b, kv_heads, h // kv_heads, d)
        shifts = torch.matmul(qg, k.abs().permute(0, 2, 3, 1)) * abs(scale) * step  # [B, Hkv, G, L]
        grow = torch.exp(2 * shifts.masked_fill(~mask[:, None, None, :], 0).amax(-1).reshape(b, h, 1))
    bound = (grow - 1) * weighted
    if pv:
        every = (v.abs() * mask[:, :, None, None]).sum(1).repeat_interleave(h // kv_heads, 1)
        bound = bound + grow * (step * weighted + step / 64 / 448 * every)
    return bound


def gathered_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor,
    block_size: int, scale: float | None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """decode_attention over whole cache blocks gathered from the paged cache (one copy per block,
    not per token): q [B, H, D], caches [slots, Hkv, D], blocks [B * W] (W blocks per sequence),
    mask [B, W * block_size] -> [B, H, D]. An FP8 cache (`k_scale`, `v_scale`: the layer's, 0-d)
    is gathered as stored and dequantized to q's dtype."""
    shape = (-1, block_size, *k_cache.shape[1:])
    ctx = (q.shape[0], -1, *k_cache.shape[1:])  # [B, W * block_size, Hkv, D]
    kd = read(select(k_cache.view(shape), blocks).view(ctx), k_scale, q.dtype)
    vd = read(select(v_cache.view(shape), blocks).view(ctx), v_scale, q.dtype)
    return decode_attention(q, kd, vd, mask, scale)


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float
) -> torch.Tensor:
    """Packed chunks, q [Tq, H, D], k/v [Tk, Hkv, D]: chunk i's queries q[cu_q[i]:cu_q[i+1]] are the
    last positions of its context k[cu_k[i]:cu_k[i+1]] (causal from the bottom right). What the
    variable-length flash kernel computes (varlen_prefill.py), one SDPA call per chunk."""
    out = torch.empty_like(q)
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(qs[:-1], qs[1:], ks[:-1], ks[1:], strict=True):
        n, length = q1 - q0, k1 - k0
        mask = causal_mask(torch.arange(length - n, length, device=q.device), length, None)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[q0:q1] = o.transpose(0, 1)
    return out
