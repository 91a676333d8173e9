"""Paged decode attention on CUDA: a Triton split-K kernel that reads K/V where they lie.

Each program takes one (sequence, KV head, context split) and walks that split of the sequence's
context one cache block at a time through its block table, for all the query heads that share the
KV head (grouped-query attention reads each K/V tile once). A second kernel merges the splits with
their running max and sum (the usual log-sum-exp merge). No gather copy of K/V, no host sync: the
launch depends only on the batch size, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    part_out_ptr,
    part_ml_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    stride_ms,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + b)
    # each sequence's blocks are spread evenly over the splits, whatever its length
    num_blocks = tl.cdiv(ctx_len, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    first_block = split * per_split
    last_block = tl.minimum(first_block + per_split, num_blocks)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for block_idx in range(first_block, last_block):
        live = block_idx * BLOCK_SIZE + t < ctx_len
        block = tl.load(table_ptr + b * stride_tb + block_idx)
        slots = block * BLOCK_SIZE + t
        kv_off = slots[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0)
        s = (
            tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
        )  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        m = m_new
    out_off = b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(part_out_ptr + out_off, acc, mask=g_ok[:, None])
    ml_off = b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(part_ml_ptr + ml_off, m, mask=g_ok)
    tl.store(part_ml_ptr + ml_off + 1, lsum, mask=g_ok)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = s < NUM_SPLITS
    ml = part_ml_ptr + b * stride_mb + h * stride_mh + s * stride_ms
    m = tl.load(ml, mask=ok, other=float("-inf"))
    lsum = tl.load(ml + 1, mask=ok, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
    denom = tl.sum(lsum * w, axis=0)
    parts = tl.load(
        part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / denom
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def num_splits_for(batch: int, kv_heads: int, num_sms: int) -> int:
    """Enough programs to cover the device about twice; fixed per batch size (graph-friendly)."""
    return max(1, min(32, -(-2 * num_sms // (batch * kv_heads))))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] block ids (int32 or int64)
    ctx_lens: torch.Tensor,  # [B] tokens of context per sequence (>= 1)
    block_size: int,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    q = q.contiguous()
    b, h, d = q.shape
    kv_heads = k_cache.shape[1]
    group = h // kv_heads
    part_out = torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b, h, num_splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        ctx_lens,
        part_out,
        part_ml,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_ml.stride(0),
        part_ml.stride(1),
        part_ml.stride(2),
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 caches stay exact
    )
    _merge_kernel[(b, h)](
        part_out,
        part_ml,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_ml.stride(0),
        part_ml.stride(1),
        part_ml.stride(2),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM=d,
    )
    return out


@dataclass(frozen=True)
class DecodeKernel:
    """The kernel bound to a cache's block size and a batch size's split count."""

    block_size: int
    num_splits: int

    @classmethod
    def for_batch(cls, cache: object, batch: int, num_sms: int) -> DecodeKernel:
        return cls(cache.block_size, num_splits_for(batch, cache.shape.num_kv_heads, num_sms))

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        ctx_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q, k_cache, v_cache, block_table, ctx_lens, self.block_size, scale, self.num_splits
        )
