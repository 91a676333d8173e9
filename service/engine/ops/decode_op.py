"""Decode attention as one opaque custom op: write the step's K/V, attend in place.

A decode-only step (one new token per sequence, rows in order) needs no packing metadata, so
its attention fits a fixed signature of tensors. Registering it as a torch custom op that
declares the caches it mutates lets `torch.compile` fuse everything around it (norms,
activations) while the op itself stays ours: Triton reading K/V in place on CUDA, the plain
torch gather on CPU (the reference the kernel is tested against). The op also applies the
rotary embedding of the step's query and key where the model leaves it (deferred_rotary.py).
An FP8 cache comes with its per-layer scales (kv_quant.py): the new K/V are quantized as they are
written, the cached ones dequantized to the query's dtype as they are read.
"""

from __future__ import annotations

import functools

import torch

from .attention_ref import decode_mask, gathered_decode_attention
from .decode_grid import num_splits_for
from .deferred_rotary import DeferredRotary, rotate
from .inference_ops import without_version_bumps
from .kv_cache import slot_major
from .kv_quant import layer_scales, write


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device: the decode kernel's split count follows them."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def kernel_supports(block_size: int, head_dim: int) -> bool:
    """The Triton kernel's tiles need blocks of at least 16 tokens and heads of at least 16
    dimensions (its matrix products' least size), each a power of two (Triton's ranges)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (block_size, head_dim))


@torch.library.custom_op("tandem::paged_decode", mutates_args=("k_store", "v_store"))
def paged_decode(
    query: torch.Tensor,  # [1, H, B, D]
    key: torch.Tensor,  # [1, Hkv, B, D]
    value: torch.Tensor,
    k_store: torch.Tensor,  # every layer's cache: [L, slots, Hkv, D], or [L, Hkv, slots, D] when head_major
    v_store: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,  # [B] where each new K/V goes
    block_table: torch.Tensor,  # [B, max_blocks] int32
    ctx_lens: torch.Tensor,  # [B] int32, context including the new token
    block_size: int,
    scale: float,
    head_major: bool = False,
    inv_freq: torch.Tensor | None = None,
    rope_scaling: float = 1.0,
    k_scale: torch.Tensor | None = None,  # [L] float32: an FP8 cache's scales (kv_cache.py)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> [1, B, H, D] attention output of each sequence's single query.

    With `inv_freq` ([D // 2] float32; deferred_rotary.py), query and key come unrotated and the
    op rotates them at each sequence's position (its context length - 1), as the model would have.

    The op takes the whole cache and the layer, not the layer's view: once a process has compiled
    for a second cache shape, Dynamo makes the cache's sizes symbolic, and Inductor then passed
    every layer's view at layer 0's offset (seen on the H200 with torch 2.11, reproduced on CPU
    with torch 2.13 by test_engines_of_different_caches_in_one_process).
    """
    # the same [slots, Hkv, D] indexing over either storage
    k_cache, v_cache = slot_major(k_store, head_major)[layer], slot_major(v_store, head_major)[layer]
    q = query[0].transpose(0, 1)  # [B, H, D]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [B, Hkv, D]
    rotary = DeferredRotary(inv_freq, rope_scaling) if inv_freq is not None else None
    kv_scales = layer_scales(k_scale, v_scale, layer)
    ks, vs = kv_scales or (None, None)
    if q.is_cuda and kernel_supports(block_size, q.shape[-1]):
        from .triton_decode import paged_decode_attention

        # the grid depends only on the batch size and the table's width (the longest context a
        # sequence may have), so it is fixed per captured graph; the kernel writes the new K/V
        # into the cache itself
        sms, longest = num_sms(q.device.index or 0), block_table.shape[1] * block_size
        splits = num_splits_for(q.shape[0], k_cache.shape[1], sms, longest=longest)
        out = paged_decode_attention(
            q, k_cache, v_cache, block_table, ctx_lens, block_size, scale, splits,
            new_kv=(new_k, new_v, slot_mapping), rotary=rotary, kv_scales=kv_scales,
        )
    else:
        if rotary is not None:
            q, new_k = rotate(ctx_lens - 1, rotary, q, new_k)
        write(k_cache, slot_mapping, new_k, ks)
        write(v_cache, slot_mapping, new_v, vs)
        width = -(-int(ctx_lens.max()) // block_size)
        blocks = block_table[:, :width].long().flatten()
        mask = decode_mask(ctx_lens.long(), width * block_size, None)
        out = gathered_decode_attention(q, k_cache, v_cache, blocks, mask, block_size, scale, ks, vs)
    return out[None]


without_version_bumps("tandem::paged_decode")  # inference only: inference_ops.py


@paged_decode.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_size: int,
    scale: float,
    head_major: bool = False,
    inv_freq: torch.Tensor | None = None,
    rope_scaling: float = 1.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
