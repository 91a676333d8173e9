"""Paged attention plugged into transformers through its attention interface.

The model code stays transformers' own: every attention layer calls `paged_attention_forward`,
which writes the step's new K/V into the paged cache, then attends each query token to the K/V
of its own sequence, through one of two custom ops: the decode op (decode_op.py) for decode-only
steps, the mixed op (mixed_op.py) for steps with prompt chunks.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from . import decode_op, mixed_op
from .attention_metadata import AttentionMetadata

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
    tandem_layer: int | None = None,  # the layer's index where a compiled layer passes it (compile_scope.py)
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if tandem_meta is None:
        raise RuntimeError("tandem_paged attention needs the engine's metadata (tandem_meta=...)")
    meta, cache = tandem_meta, tandem_meta.kv_cache
    layer = module.layer_idx if tandem_layer is None else tandem_layer
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling  # the CUDA kernels want it resolved
    # each op gets the storage itself (contiguous), and transposes inside if head-major; an FP8
    # cache its scales, as tensors (graphs and compiled steps read their values as set)
    fp8 = {"k_scale": cache.k_scale, "v_scale": cache.v_scale} if cache.quantized else {}
    if meta.decode_only:  # what torch.compile and CUDA graphs wrap
        out = decode_op.paged_decode(
            query, key, value, cache.k_store, cache.v_store, layer, meta.slot_mapping,
            meta.decode_block_table, meta.decode_ctx_lens, meta.block_size, scale, cache.head_major,
            *((meta.rotary.inv_freq, meta.rotary.scaling) if meta.rotary is not None else ()), **fp8,
        )
    else:  # prompts in the step: the op reads the step's metadata itself
        out = mixed_op.paged_mixed(
            query, key, value, cache.k_store, cache.v_store, layer, cache.head_major, scale, **fp8
        )
    return out, None


def register() -> str:
    """Make `tandem_paged` a valid `attn_implementation` for every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
