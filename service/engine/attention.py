"""Paged attention plugged into transformers through its attention interface.

The model code stays transformers' own: every attention layer calls `paged_attention_forward`,
which writes the step's new K/V into the paged cache, then attends each query token to the K/V
of its own sequence. This is the plain-torch reference path (CPU and CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from . import decode_op
from .attention_ref import decode_attention
from .batch import AttentionMetadata

ATTN_IMPLEMENTATION = "tandem_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tandem_meta: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if tandem_meta is None:
        raise RuntimeError("tandem_paged attention needs the engine's metadata (tandem_meta=...)")
    meta = tandem_meta
    if meta.decode_only:  # one opaque op: what torch.compile and CUDA graphs wrap
        cache, layer = meta.kv_cache, module.layer_idx
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        # the op gets the storage itself (contiguous), and transposes inside if head-major
        out = decode_op.paged_decode(
            query, key, value, cache.k_store, cache.v_store, layer, meta.slot_mapping,
            meta.decode_block_table, meta.decode_ctx_lens, meta.block_size, scale, cache.head_major,
            *((meta.rotary.inv_freq, meta.rotary.scaling) if meta.rotary is not None else ()),
        )
        return out, None
    return _attend_mixed(module, query, key, value, meta, scaling), None


# A graph break for the compiled prefill forward (model_runner.py): the walk over the step's
# prompts stays eager, so one graph with a symbolic token count serves every batch composition
# instead of one compilation per mix of prompt lengths
@torch.compiler.disable
def _attend_mixed(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    meta: AttentionMetadata, scaling: float | None,
) -> torch.Tensor:
    """Prefill and mixed steps: write the new K/V, then attend decode rows and prompt chunks.

    Reads the layer index here, past the graph break, so that it is no guard of the compiled
    frames (one compilation for every layer)."""
    cache, layer = meta.kv_cache, module.layer_idx
    k_cache, v_cache = cache.k[layer], cache.v[layer]  # [slots, Hkv, D] in either layout
    new_k = key[0].transpose(0, 1)  # [T, Hkv, D]
    new_v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, meta.slot_mapping, new_k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, new_v.to(v_cache.dtype))

    q = query[0]  # [H, T, D]
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling  # the CUDA kernels want it resolved
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)  # [T, H, D]
    if meta.decode_token_idx is not None:
        qd = q.index_select(1, meta.decode_token_idx).transpose(0, 1)  # [B, H, D]
        if meta.decode_kernel is not None:  # CUDA: read K/V in place
            od = meta.decode_kernel(
                qd, k_cache, v_cache, meta.decode_block_table, meta.decode_ctx_lens, scale
            )
        else:
            blocks = (-1, meta.block_size, *k_cache.shape[1:])
            ctx = (qd.shape[0], -1, *k_cache.shape[1:])
            kd = k_cache.view(blocks).index_select(0, meta.decode_blocks).view(ctx)  # [B, W * bs, Hkv, D]
            vd = v_cache.view(blocks).index_select(0, meta.decode_blocks).view(ctx)
            od = decode_attention(qd, kd, vd, meta.decode_mask, scaling)
        out.index_copy_(0, meta.decode_token_idx, od)
    if meta.varlen is not None:  # CUDA: every prompt chunk in one call
        chunks = meta.varlen.attend(q.transpose(0, 1), k_cache, v_cache, scale)
        out.index_copy_(0, meta.varlen.q_index, chunks)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        qp = q[:, rows].unsqueeze(0)  # [1, H, n, D]
        if seg.slots is None:  # fresh prompt: its own K/V are the whole context
            kp, vp = key[:, :, rows], value[:, :, rows]
        else:
            kp = k_cache[seg.slots].transpose(0, 1).unsqueeze(0)
            vp = v_cache[seg.slots].transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scaling, enable_gqa=True
        )
        out[rows] = op[0].transpose(0, 1)
    return out.unsqueeze(0)


def register() -> str:
    """Make `tandem_paged` a valid `attn_implementation` for every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
