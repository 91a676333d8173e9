"""Plain-torch attention math: the CPU path and the reference the CUDA kernel is tested against."""

from __future__ import annotations

import torch


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
