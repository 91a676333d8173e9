"""Prefill and mixed-step attention as one opaque custom op, its metadata taken from the step.

A step with prompt chunks has metadata of no fixed signature: a variable number of chunks, decode
rows or none, packed offsets whose maxima change every step. Passed into the compiled prefill
forward, any of it would be a guard (a recompilation per batch composition) or a graph break per
layer (one compiled frame per layer, each entered from Python: the host then takes longer to queue
a step than the device takes to run it). So the op's signature holds only what every layer has
(the layer's Q/K/V, the whole cache, the layer index) and it reads the rest from the step the
runner is running (`attending`), as vLLM's attention op reads its forward context. The compiled
forward is then one graph for every step with prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata, PrefillSegment
from .attention_ref import gathered_decode_attention
from .deferred_rotary import rotate
from .kv_cache import slot_major

_step: ContextVar[AttentionMetadata | None] = ContextVar("tandem_step", default=None)


@contextmanager
def attending(meta: AttentionMetadata) -> Iterator[None]:
    """The step whose metadata `paged_mixed` reads, for the forward run inside."""
    token = _step.set(meta)
    try:
        yield
    finally:
        _step.reset(token)


@torch.library.custom_op("tandem::paged_mixed", mutates_args=("k_store", "v_store"))
def paged_mixed(
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    k_store: torch.Tensor,  # every layer's cache, in its storage layout (kv_cache.py)
    v_store: torch.Tensor,
    layer: int,
    head_major: bool,
    scale: float,
) -> torch.Tensor:
    """-> [1, T, H, D]: write the step's new K/V (Q and K rotated first where the model leaves the
    rotary embedding to the op), then attend its decode rows and prompt chunks."""
    meta = _step.get()
    if meta is None:
        raise RuntimeError("tandem::paged_mixed runs only inside attending(meta)")
    k_cache, v_cache = slot_major(k_store, head_major)[layer], slot_major(v_store, head_major)[layer]
    q, new_k, new_v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    q, new_k = _write_new_kv(meta, q, new_k, new_v, k_cache, v_cache)
    decodes = meta.num_decode_first
    if decodes is not None:  # decode rows first, then the chunks in order: every part a slice
        parts = []
        if decodes:
            parts.append(_decode_rows(meta, q[:decodes], k_cache, v_cache, scale))
        if meta.varlen is not None:
            parts.append(meta.varlen.attend(q[decodes:], k_cache, v_cache, scale))
        parts += [_segment(seg, q, new_k, new_v, k_cache, v_cache, scale) for seg in meta.prefills]
        return (torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()).unsqueeze(0)
    out = torch.empty_like(q)  # [T, H, D]
    if meta.decode_token_idx is not None:
        od = _decode_rows(meta, q.index_select(0, meta.decode_token_idx), k_cache, v_cache, scale)
        out.index_copy_(0, meta.decode_token_idx, od)
    if meta.varlen is not None:  # CUDA: every prompt chunk in one call
        chunks = meta.varlen.attend(q.index_select(0, meta.varlen.q_index), k_cache, v_cache, scale)
        out.index_copy_(0, meta.varlen.q_index, chunks)
    for seg in meta.prefills:
        out[seg.q_start : seg.q_start + seg.q_len] = _segment(seg, q, new_k, new_v, k_cache, v_cache, scale)
    return out.unsqueeze(0)


def _decode_rows(
    meta: AttentionMetadata, qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """qd [B, H, D]: the decode rows' queries -> their outputs, each over its own context."""
    if meta.decode_kernel is not None:  # CUDA: read K/V in place
        return meta.decode_kernel(qd, k_cache, v_cache, meta.decode_block_table, meta.decode_ctx_lens, scale)
    return gathered_decode_attention(
        qd, k_cache, v_cache, meta.decode_blocks, meta.decode_mask, meta.block_size, scale
    )


def _write_new_kv(
    meta: AttentionMetadata, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write the step's new K/V ([T, Hkv, D]) into the cache, Q and K rotated first where the model
    leaves the rotary embedding to the op -> (the queries, the keys: None where only the cache is
    read, as by the packed prompt chunks and the decode rows)."""
    if q.is_cuda and write_kernel_supports(q.shape[-1]):  # one kernel
        from .triton_kv_write import write_step_kv

        return write_step_kv(q, new_k, new_v, k_cache, v_cache, meta.slot_mapping, meta.positions,
                             meta.rotary, keys=bool(meta.prefills))
    if meta.rotary is not None:
        q, new_k = rotate(meta.positions, meta.rotary, q, new_k)
    k_cache.index_copy_(0, meta.slot_mapping, new_k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, new_v.to(v_cache.dtype))
    return q, new_k


def write_kernel_supports(head_dim: int) -> bool:
    """The write kernel's rows need a power-of-two head size (Triton's ranges)."""
    return head_dim & (head_dim - 1) == 0


def _segment(
    seg: PrefillSegment, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One prompt chunk by SDPA (q [T, H, D] and the new K/V [T, Hkv, D] of the step) -> [n, H, D]."""
    rows = slice(seg.q_start, seg.q_start + seg.q_len)
    qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if seg.slots is None:  # fresh prompt: its own K/V are the whole context
        kp, vp = new_k[rows].transpose(0, 1).unsqueeze(0), new_v[rows].transpose(0, 1).unsqueeze(0)
    else:
        kp = k_cache[seg.slots].transpose(0, 1).unsqueeze(0)
        vp = v_cache[seg.slots].transpose(0, 1).unsqueeze(0)
    op = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale, enable_gqa=True
    )
    return op[0].transpose(0, 1)


@paged_mixed.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    layer: int,
    head_major: bool,
    scale: float,
) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
