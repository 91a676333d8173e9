"""Prefill and mixed-step attention as one opaque custom op, its metadata taken from the step.

A step with prompt chunks has metadata of no fixed signature: a variable number of chunks, decode
rows or none, packed offsets whose maxima change every step. Passed into the compiled prefill
forward, any of it would be a guard (a recompilation per batch composition) or a graph break per
layer (one compiled frame per layer, each entered from Python: the host then takes longer to queue
a step than the device takes to run it). So the op's signature holds only what every layer has
(the layer's Q/K/V, the whole cache, the layer index) and it reads the rest from the step the
runner is running (`attending`), as vLLM's attention op reads its forward context. The compiled
forward is then one graph for every step with prompts.

With an FP8 cache (its per-layer scales passed in, kv_quant.py), every token attends to K/V as the
cache holds them, a fresh prompt's own included: a step's result then does not depend on whether
its context came from this step, an earlier one, the prefix cache or the host pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata, PrefillSegment
from .attention_ref import gathered_decode_attention
from .deferred_rotary import rotate
from .inference_ops import without_version_bumps
from .kv_cache import slot_major
from .kv_quant import layer_scales, read, round_trip, select, write

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
    k_scale: torch.Tensor | None = None,  # [L] float32: an FP8 cache's scales (kv_cache.py)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> [1, T, H, D]: write the step's new K/V (Q and K rotated first where the model leaves the
    rotary embedding to the op), then attend its decode rows and prompt chunks."""
    meta = _step.get()
    if meta is None:
        raise RuntimeError("tandem::paged_mixed runs only inside attending(meta)")
    k_cache, v_cache = slot_major(k_store, head_major)[layer], slot_major(v_store, head_major)[layer]
    q, new_k, new_v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    kv = _Cache(k_cache, v_cache, *(layer_scales(k_scale, v_scale, layer) or (None, None)))
    q, new_k = _write_new_kv(meta, q, new_k, new_v, kv)
    decodes = meta.num_decode_first
    if decodes is not None:  # decode rows first, then the chunks in order: every part a slice
        parts = []
        if decodes:
            parts.append(_decode_rows(meta, q[:decodes], kv, scale))
        if meta.varlen is not None:
            parts.append(meta.varlen.attend(q[decodes:], kv.k, kv.v, scale, kv.k_scale, kv.v_scale))
        parts += [_segment(seg, q, new_k, new_v, kv, scale) for seg in meta.prefills]
        return (torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()).unsqueeze(0)
    out = torch.empty_like(q)  # [T, H, D]
    if meta.decode_token_idx is not None:
        od = _decode_rows(meta, q.index_select(0, meta.decode_token_idx), kv, scale)
        out.index_copy_(0, meta.decode_token_idx, od)
    if meta.varlen is not None:  # CUDA: every prompt chunk in one call
        chunks = meta.varlen.attend(q.index_select(0, meta.varlen.q_index), kv.k, kv.v, scale, kv.k_scale,
                                    kv.v_scale)
        out.index_copy_(0, meta.varlen.q_index, chunks)
    for seg in meta.prefills:
        out[seg.q_start : seg.q_start + seg.q_len] = _segment(seg, q, new_k, new_v, kv, scale)
    return out.unsqueeze(0)


class _Cache(NamedTuple):
    """One layer's K/V cache ([slots, Hkv, D] views) and, for an FP8 cache, its scales (0-d)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.k_scale, self.v_scale) if self.k_scale is not None else None


def _decode_rows(meta: AttentionMetadata, qd: torch.Tensor, kv: _Cache, scale: float) -> torch.Tensor:
    """qd [B, H, D]: the decode rows' queries -> their outputs, each over its own context."""
    if meta.decode_kernel is not None:  # CUDA: read K/V in place
        return meta.decode_kernel(qd, kv.k, kv.v, meta.decode_block_table, meta.decode_ctx_lens, scale,
                                  kv.scales)
    return gathered_decode_attention(
        qd, kv.k, kv.v, meta.decode_blocks, meta.decode_mask, meta.block_size, scale, kv.k_scale, kv.v_scale
    )


def _write_new_kv(
    meta: AttentionMetadata, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, kv: _Cache
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write the step's new K/V ([T, Hkv, D]) into the cache, Q and K rotated first where the model
    leaves the rotary embedding to the op -> (the queries, the keys: None where only the cache is
    read, as by the packed prompt chunks and the decode rows)."""
    if q.is_cuda and write_kernel_supports(q.shape[-1]):  # one kernel
        from .triton_kv_write import write_step_kv

        return write_step_kv(q, new_k, new_v, kv.k, kv.v, meta.slot_mapping, meta.positions,
                             meta.rotary, keys=bool(meta.prefills), kv_scales=kv.scales)
    if meta.rotary is not None:
        q, new_k = rotate(meta.positions, meta.rotary, q, new_k)
    write(kv.k, meta.slot_mapping, new_k, kv.k_scale)
    write(kv.v, meta.slot_mapping, new_v, kv.v_scale)
    return q, new_k


def write_kernel_supports(head_dim: int) -> bool:
    """The write kernel's rows need a power-of-two head size (Triton's ranges)."""
    return head_dim & (head_dim - 1) == 0


def _segment(
    seg: PrefillSegment, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, kv: _Cache, scale: float
) -> torch.Tensor:
    """One prompt chunk by SDPA (q [T, H, D] and the new K/V [T, Hkv, D] of the step) -> [n, H, D]."""
    rows = slice(seg.q_start, seg.q_start + seg.q_len)
    qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if seg.slots is None:  # fresh prompt: its own K/V are the whole context (as an FP8 cache holds them)
        k, v = new_k[rows], new_v[rows]
        if kv.scales is not None:
            k, v = round_trip(k, kv.k_scale), round_trip(v, kv.v_scale)
    else:
        k = read(select(kv.k, seg.slots), kv.k_scale, q.dtype)
        v = read(select(kv.v, seg.slots), kv.v_scale, q.dtype)
    kp, vp = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    op = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale, enable_gqa=True
    )
    return op[0].transpose(0, 1)


without_version_bumps("tandem::paged_mixed")  # inference only: inference_ops.py


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
