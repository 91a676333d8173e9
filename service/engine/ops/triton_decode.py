"""Paged decode attention on CUDA: a Triton split-K kernel that reads K/V where they lie.

Each program takes one (sequence, KV head, context split) and walks that split of the sequence's
context one tile of tokens at a time (several cache blocks, found through the block table), for
all the query heads that share the KV head (grouped-query attention reads each K/V tile once).
A longer context gets more splits, within the grid's, so that few long sequences still keep every
multiprocessor reading. In a decode step the kernel also writes the step's new K/V into the cache:
one launch, not three; where the deferred model leaves the rotary embedding to it, it rotates Q and
the new K as it loads them (deferred_rotary.py).
A second kernel merges the splits with their running max and sum (the usual log-sum-exp merge).
No gather copy of K/V, no host sync: the launch depends only on the batch size and the block
table's width, so it can be captured in a CUDA graph.
An FP8 cache (KV_FP8) is read tile by tile into float32, times the layer's scale, then the query's
dtype for the matrix products; the step's new K/V are quantized as they are stored, and the program
that uses them from registers uses them as stored, round-tripped (kv_quant.py has the arithmetic).
A configuration may instead take P.V with e4m3 operands (PV_FP8: V's tiles as stored, the
probabilities rounded to e4m3) and Q.K^T (QK_FP8: K's tiles as stored, each query row rounded to
e4m3): the tiles reach shared memory as stored, and the tensor cores take them widened to float16 in
the registers that feed them (sm_90's FP8 matrix instructions take 64 rows, a program holds 16);
what the rounding costs in accuracy: scripts/fp8_attention_products.py. Or both products take
float16 operands (F16_PRODUCTS): the tiles widened from e4m3 (exact) with no scale, the query and
probabilities in float16, the scales applied to the products' float32 results: one conversion per
two elements where dequantizing takes one each to float32, a multiply and one to the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .decode_grid import MAX_SPLITS, KernelConfig, Splits, engine_configs, kernel_config, num_splits_for
from .deferred_rotary import DeferredRotary
from .kv_quant import is_fp8
from .triton_fp8 import dequantize, quantize
from .triton_rotary import rotary_cos_sin


@triton.jit
def _slots(block, pos, BLOCK_SIZE: tl.constexpr, OFFSET_I64: tl.constexpr):
    """Cache slot of each position from its block id; 64-bit only where the cache needs it."""
    if OFFSET_I64:
        block = block.to(tl.int64)
    return block * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _splits_of(ctx_len, least, most, SPLIT_TOKENS: tl.constexpr):
    """Splits of one sequence's context: one per SPLIT_TOKENS tokens, within [least, most]."""
    return tl.minimum(tl.maximum(tl.cdiv(ctx_len, SPLIT_TOKENS), least), most)


@triton.jit
def _tile_range(tokens, split, splits, TILE: tl.constexpr):
    """The tiles of a context of `tokens` that split `split` of `splits` walks: each sequence's
    tiles spread evenly over its splits, whatever its length (a split may get none)."""
    num_tiles = tl.cdiv(tokens, TILE)
    per_split = tl.cdiv(num_tiles, splits)
    first_tile = split * per_split
    return first_tile, tl.minimum(first_tile + per_split, num_tiles)


@triton.jit
def _load_tile(k_ptr, v_ptr, table_ptr, b, kvh, tile, tokens, t, d, stride_tb, stride_ks, stride_kh,
               BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, OFFSET_I64: tl.constexpr):
    """One tile of a sequence's K and V for one KV head, [TILE, head_dim] each, positions past
    `tokens` zero: a tile spans several cache blocks, each token finds its block through the
    table. -> positions, which of them are live, K, V."""
    pos = tile * TILE + t
    live = pos < tokens
    block = tl.load(table_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=live, other=0)
    slots = _slots(block, pos, BLOCK_SIZE, OFFSET_I64)
    kv_off = slots[:, None] * stride_ks + kvh * stride_kh + d[None, :]
    k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0)
    return pos, live, k, v


@triton.jit
def _attend_tile(q, k, v, live, m, lsum, acc, scale, v_scale, DOT_PRECISION: tl.constexpr,
                 PV_FP8: tl.constexpr, QK_FP8: tl.constexpr = False, SCALE_PV: tl.constexpr = False):
    """One tile of K and V [TILE, head_dim] into the query heads' running softmax: the scores
    Q.K^T [GROUP_PAD, TILE] (positions not `live` left out), then P.V into `acc`. -> m, lsum, acc.
    PV_FP8: V as an e4m3 cache stores it (`v_scale` its scale) and the probabilities (<= 1) times
    P_FP8 in e4m3, their product taken with e4m3 operands; their sum stays float32. QK_FP8: q in
    e4m3 and K as stored, `scale` [GROUP_PAD, 1] the product's scale per query row. SCALE_PV: V
    unscaled (widened from e4m3), P.V times `v_scale`."""
    if QK_FP8:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    if PV_FP8:
        pv = tl.dot((p * P_FP8).to(v.dtype), v, out_dtype=tl.float32) * (v_scale / P_FP8)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        if SCALE_PV:
            pv = pv * v_scale
    acc = acc * alpha[:, None] + pv
    return m_new, lsum, acc


# the probabilities' scale into e4m3 (PV_FP8): the largest, 1, to e4m3's largest value
P_FP8 = tl.constexpr(448.0)


# Triton compiles a variant per value class of its integer arguments (1, a multiple of 16, other):
# the split counts and the strides that follow them change from step to step, so they are not
# specialised on, and the variants a step can launch are few enough to compile before serving
RUN_TIME_ARGS = dict(do_not_specialize=["least_splits", "num_splits"],
                     do_not_specialize_on_alignment=["stride_mb", "stride_mh"])
# an FP8 cache's scales: one layer's is a 4-byte step into the [layers] tensor, 16-byte aligned for
# some layers only, so alignment would compile a second variant (mid-serving, for a mixed step)
SPLIT_RUN_TIME_ARGS = dict(RUN_TIME_ARGS, do_not_specialize_on_alignment=[
    *RUN_TIME_ARGS["do_not_specialize_on_alignment"], "k_scale_ptr", "v_scale_ptr"])


@triton.jit(**SPLIT_RUN_TIME_ARGS)
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    new_k_ptr,
    new_v_ptr,
    slot_ptr,
    inv_freq_ptr,
    k_scale_ptr,
    v_scale_ptr,
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    scale,
    rope_scaling,
    least_splits,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    DIRECT: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    STORE_NEW: tl.constexpr,
    ROTARY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OFFSET_I64: tl.constexpr,
    NEW_AFTER_LOOP: tl.constexpr,
    SINGLE_SPLIT_DIRECT: tl.constexpr,
    KV_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    QK_FP8: tl.constexpr,
    F16_PRODUCTS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + b)
    # each sequence's tiles are spread evenly over its splits, whatever its length
    splits = _splits_of(ctx_len, least_splits, num_splits, SPLIT_TOKENS)
    if split >= splits:  # a short context in a grid sized for long ones
        return
    # NEW_AFTER_LOOP: the tiles hold the cached context only, the step's own token joins after them
    cached = ctx_len - 1 if (STORE_NEW and NEW_AFTER_LOOP) else ctx_len
    first_tile, last_tile = _tile_range(cached, split, splits, TILE)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, TILE)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    new_pos = ctx_len - 1
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=g_ok[:, None], other=0.0)
    k_scale, v_scale = 1.0, 1.0
    if KV_FP8:  # the layer's scales (0-d tensors: set in place, read by captured graphs)
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    if ROTARY:  # Q (and below, the new K) rotated at the new token's position
        dtype = q_ptr.dtype.element_ty
        cos, sin, pair, sign = rotary_cos_sin(inv_freq_ptr, rope_scaling, new_pos, d, HEAD_DIM, dtype)
        q_pair = tl.load(q_rows + pair[None, :], mask=g_ok[:, None], other=0.0)
        q = (q.to(tl.float32) * cos + sign * q_pair.to(tl.float32) * sin).to(dtype)
    q_tiles, tile_scale, q_f32 = q, scale, q.to(tl.float32)
    if QK_FP8:  # each query row scaled to e4m3's range, the product's scale per row
        q_scale = tl.maximum(tl.max(tl.abs(q_f32), axis=1), 1e-30) / P_FP8
        q_tiles = quantize(q_f32, q_scale[:, None], k_ptr.dtype.element_ty)
        tile_scale = (q_scale * k_scale * scale)[:, None]
        q_f32 = q_tiles.to(tl.float32) * q_scale[:, None]  # the step's own token: the same query
    if F16_PRODUCTS:  # the tiles unscaled: K's scale joins the scores'
        q_tiles = q.to(tl.float16)
        tile_scale = scale * k_scale
    if STORE_NEW:
        # the step's own K/V: one program writes it to the cache (no program reads that slot this
        # step) and uses it from registers: the program whose tiles hold its position substitutes
        # it into that tile; or (NEW_AFTER_LOOP) the last split, whose tiles may be none, takes its
        # score now and the token into its running softmax after its tiles
        new_k_row = new_k_ptr + b * stride_nkb + kvh * stride_nkh
        new_k = tl.load(new_k_row + d)
        if ROTARY:  # with Q's cos and sin
            k_pair = tl.load(new_k_row + pair)
            new_k = new_k.to(tl.float32) * cos + sign * k_pair.to(tl.float32) * sin
            new_k = new_k.to(new_k_ptr.dtype.element_ty)  # the model's dtype, as its rotary's output
        if KV_FP8:
            new_k = quantize(new_k, k_scale, k_ptr.dtype.element_ty)
            new_v = quantize(tl.load(new_v_ptr + b * stride_nvb + kvh * stride_nvh + d), v_scale,
                              v_ptr.dtype.element_ty)
        else:
            new_k = new_k.to(k_ptr.dtype.element_ty)
            new_v = tl.load(new_v_ptr + b * stride_nvb + kvh * stride_nvh + d).to(v_ptr.dtype.element_ty)
        if NEW_AFTER_LOOP:
            owner = split == splits - 1
        else:
            owner = (new_pos // TILE >= first_tile) & (new_pos // TILE < last_tile)
        new_off = tl.load(slot_ptr + b).to(tl.int64) * stride_ks + kvh * stride_kh + d
        tl.store(k_ptr + new_off, new_k, mask=owner & (d < HEAD_DIM))
        tl.store(v_ptr + new_off, new_v, mask=owner & (d < HEAD_DIM))
        if KV_FP8:  # from here on, as the cached tiles are read
            new_k = dequantize(new_k, k_scale, q_ptr.dtype.element_ty)
            new_v = dequantize(new_v, v_scale, q_ptr.dtype.element_ty)
        if NEW_AFTER_LOOP:  # -inf outside the owner: the token is taken once
            s_new = tl.sum(q_f32 * new_k.to(tl.float32)[None, :], axis=1) * scale
            s_new = tl.where(owner, s_new, float("-inf"))
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in tl.range(first_tile, last_tile):
        pos, live, k, v = _load_tile(k_ptr, v_ptr, table_ptr, b, kvh, tile, cached, t, d, stride_tb,
                                     stride_ks, stride_kh, BLOCK_SIZE, TILE, OFFSET_I64)
        if F16_PRODUCTS:  # e4m3 in float16 exactly, the scales after the products
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        elif KV_FP8:
            if not QK_FP8:  # else K's tiles go to the tensor cores as stored
                k = dequantize(k, k_scale, q_ptr.dtype.element_ty)
            if not PV_FP8:  # and V's
                v = dequantize(v, v_scale, q_ptr.dtype.element_ty)
        if STORE_NEW and not NEW_AFTER_LOOP:  # the new token's slot is written this step: from registers
            is_new = (pos == new_pos)[:, None]
            k = tl.where(is_new, new_k[None, :], k)
            v = tl.where(is_new, new_v[None, :], v)
        m, lsum, acc = _attend_tile(q_tiles, k, v, live, m, lsum, acc, tile_scale, v_scale, DOT_PRECISION,
                                    PV_FP8, QK_FP8, F16_PRODUCTS)
    if STORE_NEW and NEW_AFTER_LOOP:
        # the new token after the cached context's tiles (an empty split stays empty: no exp of
        # -inf minus -inf)
        m_new = tl.maximum(m, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p_new = tl.exp(s_new - m_safe)
        lsum = lsum * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * new_v.to(tl.float32)[None, :]
        m = m_new
    # one split for every sequence (no merge launch), or for this one (the merge skips it)
    if DIRECT or (SINGLE_SPLIT_DIRECT and splits == 1):
        out = acc / lsum[:, None]
        out_off = b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        part_off = b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(part_out_ptr + part_off, acc, mask=g_ok[:, None])
        ml_off = b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(part_ml_ptr + ml_off, m, mask=g_ok)
        tl.store(part_ml_ptr + ml_off + 1, lsum, mask=g_ok)


@triton.jit(**RUN_TIME_ARGS)
def _merge_kernel(
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    lens_ptr,
    least_splits,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SINGLE_SPLIT_DIRECT: tl.constexpr,
):
    """The splits' partial outputs of HEADS query heads of one sequence, merged by their running
    max and sum (a log-sum-exp merge)."""
    b = tl.program_id(0)
    splits = _splits_of(tl.load(lens_ptr + b), least_splits, num_splits, SPLIT_TOKENS)
    if SINGLE_SPLIT_DIRECT and splits == 1:  # its one split wrote the output
        return
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = h < NUM_HEADS
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = h_ok[:, None] & (s < splits)[None, :]
    ml = part_ml_ptr + b * stride_mb + h[:, None] * stride_mh + s[None, :] * stride_ms
    m = tl.load(ml, mask=ok, other=float("-inf"))  # [HEADS, SPLITS_PAD]
    lsum = tl.load(ml + 1, mask=ok, other=0.0)
    m_all = tl.max(m, axis=1)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all[:, None]), 0.0)
    denom = tl.sum(lsum * w, axis=1)
    parts = tl.load(
        part_out_ptr + b * stride_pb + h[:, None, None] * stride_ph + s[None, :, None] * stride_ps
        + d[None, None, :],
        mask=ok[:, :, None],
        other=0.0,
    )
    out = tl.sum(parts * w[:, :, None], axis=1) / denom[:, None]
    out_off = b * stride_ob + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def _max_offset(t: torch.Tensor) -> int:
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] block ids (int32 or int64)
    ctx_lens: torch.Tensor,  # [B] tokens of context per sequence (>= 1)
    block_size: int,
    scale: float,
    num_splits: int | Splits,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rotary: DeferredRotary | None = None,
    config: KernelConfig | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one query over its paged context.

    `num_splits`: programs per sequence and KV head, the same for every sequence (an int) or
    following each one's context (Splits).

    `new_kv` = (key [B, Hkv, D], value, slot_mapping [B]): the step's own K/V, written into the
    cache at `slot_mapping` by the kernel itself (the last context position of each sequence),
    instead of by a separate copy beforehand.
    `rotary`: q and the new key come unrotated; the kernel rotates them at position ctx_len - 1.
    `config`: the engine's for this batch size (`kernel_config`) unless given.
    `kv_scales` = (k_scale, v_scale), 0-d float32 tensors: the caches are FP8 (e4m3) with these
    scales; the output is in q's dtype all the same.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()  # any batch and head strides will do (no copy of the model's layout)
    b, h, d = q.shape
    kv_heads = k_cache.shape[1]
    fp8 = kv_scales is not None
    assert fp8 == is_fp8(k_cache.dtype) == is_fp8(v_cache.dtype), "an FP8 cache comes with its scales"
    config = config or kernel_config(b, fp8, store_new=new_kv is not None)
    # e4m3 or float16 products need e4m3 tiles, and the step's own token taken after the loop
    # (in float32); float16 ones take both products
    other_products = config.pv_fp8 or config.qk_fp8 or config.f16_products
    assert not other_products or (fp8 and (new_kv is None or config.new_after_loop)), config
    assert not (config.f16_products and (config.pv_fp8 or config.qk_fp8)), config
    group = h // kv_heads
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    splits = num_splits if isinstance(num_splits, Splits) else Splits(num_splits, num_splits)
    num_splits = splits.most
    if num_splits > 1:  # each split's partial output, max and sum, for the merge
        part_out = torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, h, num_splits, 2, dtype=torch.float32, device=q.device)
    else:  # unused pointers: the kernel writes `out` itself
        part_out = part_ml = out
    if new_kv is not None:
        new_k, new_v, slot_mapping = new_kv
        if new_k.stride(-1) != 1 or new_v.stride(-1) != 1:
            new_k, new_v = new_k.contiguous(), new_v.contiguous()
    else:  # unused pointers
        new_k, new_v, slot_mapping = k_cache, v_cache, ctx_lens
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        ctx_lens,
        new_k,
        new_v,
        slot_mapping,
        rotary.inv_freq if rotary is not None else ctx_lens,  # unused pointer without rotary
        *(kv_scales if fp8 else (ctx_lens, ctx_lens)),  # unused pointers without FP8
        part_out,
        part_ml,
        out,
        scale,
        rotary.scaling if rotary is not None else 1.0,
        splits.least,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_table.stride(0),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_ml.stride(0),
        part_ml.stride(1),
        part_ml.stride(2),
        out.stride(0),
        out.stride(1),
        DIRECT=num_splits == 1,
        SPLIT_TOKENS=splits.tokens,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        TILE=config.tile,
        STORE_NEW=new_kv is not None,
        ROTARY=rotary is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 caches stay exact
        # 32-bit address arithmetic unless a cache's elements outgrow it
        OFFSET_I64=max(_max_offset(k_cache), _max_offset(v_cache)) >= 2**31,
        NEW_AFTER_LOOP=config.new_after_loop,
        SINGLE_SPLIT_DIRECT=config.single_split_direct,
        KV_FP8=fp8,
        PV_FP8=config.pv_fp8,
        QK_FP8=config.qk_fp8,
        # a float32 model's queries keep their precision (its tests' references are exact)
        F16_PRODUCTS=config.f16_products and q.dtype != torch.float32,
        **config.launch_options,
    )
    if num_splits == 1:  # the split kernel wrote the output itself
        return out
    merge_args = (part_out, part_ml, out, ctx_lens, splits.least, num_splits, part_out.stride(0),
                  part_out.stride(1), part_out.stride(2), part_ml.stride(0), part_ml.stride(1),
                  part_ml.stride(2), out.stride(0), out.stride(1))
    merge_consts = dict(SPLIT_TOKENS=splits.tokens, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
                        HEAD_DIM=d, SINGLE_SPLIT_DIRECT=config.single_split_direct,
                        num_warps=config.merge_warps)
    heads = config.merge_heads  # query heads of a sequence per merge program
    _merge_kernel[(b, triton.cdiv(h, heads))](*merge_args, NUM_HEADS=h, HEADS=heads, **merge_consts)
    return out


def compile_step_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, heads: int,
                          table_width: int, dtype: torch.dtype,
                          kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Compile, before serving, every variant a mixed step's decode rows may launch (each
    configuration `kernel_config` picks, with and without a merge, and the merge at each padded
    split count up to MAX_SPLITS: a few rows take many splits; no new K/V, no rotary), on one row
    reading the cache's first block. Captured decode steps compile theirs as they are captured.
    `dtype`: the model's (the queries'), which an FP8 cache's (`kv_scales`) is not."""
    dev = k_cache.device
    q = torch.zeros(1, heads, k_cache.shape[-1], dtype=dtype, device=dev)
    table = torch.zeros(1, table_width, dtype=torch.int32, device=dev)  # the step buffers' width
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    # one count per power of two the merge pads to (SPLITS_PAD)
    split_counts = sorted({min(2**i, MAX_SPLITS) for i in range((MAX_SPLITS - 1).bit_length() + 1)})
    for config in engine_configs(kv_scales is not None, store_new=False):
        for splits in split_counts:
            paged_decode_attention(q, k_cache, v_cache, table, lens, block_size, 1.0, splits, config=config,
                                   kv_scales=kv_scales)


@dataclass(frozen=True)
class DecodeKernel:
    """The kernel bound to a cache's block size and a batch size's split counts."""

    block_size: int
    num_splits: Splits

    @classmethod
    def for_batch(cls, cache: object, batch: int, num_sms: int, longest: int) -> DecodeKernel:
        return cls(cache.block_size, num_splits_for(batch, cache.shape.num_kv_heads, num_sms, longest))

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        ctx_lens: torch.Tensor,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q, k_cache, v_cache, block_table, ctx_lens, self.block_size, scale, self.num_splits,
            kv_scales=kv_scales,
        )
