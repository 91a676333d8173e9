"""A step's inputs: the host's (`StepInputs`, built by batch_builder.py), their device views
(`DeviceBatch`, a slot's buffers: step_buffers.py), the attention metadata built from both, and the
carry-over of tokens still in flight.

All scheduled tokens are packed into one row ([1, T]) so prefill chunks and decodes of many
sequences run in one forward; the attention metadata tells each token where its K/V live. Each
buffer has one name, the same here, in the slot's buffers and in the attention metadata.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ops.attention_metadata import AttentionMetadata, PrefillSegment
from .ops.attention_ref import causal_mask, decode_mask
from .ops.deferred_rotary import DeferredRotary
from .ops.kv_cache import KVCache
from .ops.varlen_prefill import Stage, VarlenPrefill, upload


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [S] float32
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, 0 = off
    seeds: torch.Tensor  # [S] int64
    steps: torch.Tensor  # [S] int64, index of the token being sampled within the request's output
    all_greedy: bool
    needs_filter: bool  # any top-k / top-p in the batch
    num_logprobs: int  # -1 = none wanted; else top alternatives to return (0 = just the chosen one)


@dataclass
class DeviceBatch:
    """Device views of one step's inputs (the first rows of a slot's buffers)."""

    input_ids: torch.Tensor  # [T] with placeholders where `carry` >= 0
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    carry: torch.Tensor  # [T] row of the previous step's tokens to take, or -1
    logits_indices: torch.Tensor  # [S]
    decode_token_idx: torch.Tensor  # [B] packed index of each decode's token
    decode_block_table: torch.Tensor  # [B, max_blocks] int32, decode rows
    decode_ctx_lens: torch.Tensor  # [B] int32
    sampling: SamplingTensors


@dataclass
class StepInputs:
    """One step's inputs on the host (staged into a slot's pinned buffers on upload) and the map of
    its sampled rows to the scheduler's chunks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [S] packed index of each sampling sequence's last token
    sample_chunks: list[int]  # chunk index (in the scheduler output) of each sampled row
    decode_token_idx: list[int]
    decode_block_table: torch.Tensor | None  # [B, max_blocks] int32
    decode_ctx_lens: torch.Tensor | None  # [B]
    prefills: list[tuple[int, int, int, array | None]]  # (q_start, q_len, ctx_len, block ids)
    sampling: SamplingTensors
    # async loop: per token, the row of the previous step's sampled tokens that is its input
    # (the host holds a placeholder there), or -1; None when nothing is carried
    carry: torch.Tensor | None = None
    # prompt logprobs of the sequences that ask (None: no row of the step needs any)
    prompt: PromptRows | None = None


@dataclass
class PromptRows:
    """The prompt positions of a step whose logits give prompt logprobs: only sequences that ask
    have any, so a step without them keeps only its sampled rows' logits."""

    indices: torch.Tensor  # [P] packed index of each position
    targets: torch.Tensor  # [P] the prompt token after it: the one whose logprob it gives
    chunks: list[tuple[int, int]]  # (chunk index, rows of it), in row order
    top: int  # top tokens to report per row (the most any of the step's sequences asks)


def _slots_of(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[..., blocks] block ids -> [..., length] cache slots of positions 0..length-1."""
    offsets = torch.arange(block_size, device=block_table.device)
    slots = block_table.unsqueeze(-1) * block_size + offsets
    return slots.flatten(-2)[..., :length]


def decode_metadata(dev: DeviceBatch, cache: KVCache, rotary: DeferredRotary | None) -> AttentionMetadata:
    """A decode-only step's metadata (rows are the decodes, in order): what the decode op reads,
    for the eager step and for the graph captured over a slot's buffers alike. `rotary`: the
    deferred model leaves the rotary embedding to the op."""
    return AttentionMetadata(
        slot_mapping=dev.slot_mapping,
        block_size=cache.block_size,
        kv_cache=cache,
        decode_only=True,
        decode_block_table=dev.decode_block_table,
        decode_ctx_lens=dev.decode_ctx_lens,
        rotary=rotary,
    )


def build_attention_metadata(
    batch: StepInputs,
    dev: DeviceBatch,
    cache: KVCache,
    sliding_window: int | None = None,
    decode_kernel: Callable[..., torch.Tensor] | None = None,
    varlen: Stage | None = None,
    rotary: DeferredRotary | None = None,
) -> AttentionMetadata:
    """Attention metadata of an eagerly run step, from its uploaded inputs (`dev`).

    `varlen`: the prompt chunks go to one variable-length flash-attention call (CUDA, no sliding
    window), their indexes put on the device by this (the step slot's `stage`); otherwise each
    chunk gets its own segment, attended by SDPA. `rotary`: the deferred model's (the ops rotate
    Q and K)."""
    device = dev.input_ids.device
    block_size = cache.block_size
    if batch.decode_block_table is not None and not batch.prefills and not sliding_window:
        return decode_metadata(dev, cache, rotary)
    meta = AttentionMetadata(slot_mapping=dev.slot_mapping, block_size=block_size, kv_cache=cache,
                             rotary=rotary, positions=dev.positions if rotary is not None else None)
    rows = batch.decode_token_idx  # increasing: the chunks' order
    if not rows or rows[-1] == len(rows) - 1:  # the decode rows come first (as scheduled, nearly always)
        meta.num_decode_first = len(rows)
    if batch.decode_block_table is not None:
        if decode_kernel is not None:
            meta.decode_kernel = decode_kernel
            meta.decode_token_idx = dev.decode_token_idx
            meta.decode_block_table = dev.decode_block_table
            meta.decode_ctx_lens = dev.decode_ctx_lens
        else:
            # whole blocks are gathered (one copy per block, not per token); the mask hides the tail
            meta.decode_token_idx = dev.decode_token_idx
            meta.decode_blocks = dev.decode_block_table.long().flatten()
            width = dev.decode_block_table.shape[1] * block_size
            meta.decode_mask = decode_mask(dev.decode_ctx_lens.long(), width, sliding_window)
    if varlen is not None and batch.prefills and not sliding_window:
        segments = [
            (q_start, q_len, batch.slot_mapping[q_start : q_start + q_len] if blocks is None
             else _slots_of(torch.frombuffer(blocks, dtype=torch.int32).long(), ctx_len, block_size))
            for q_start, q_len, ctx_len, blocks in batch.prefills
        ]
        meta.varlen = VarlenPrefill.build(segments, varlen)
        return meta
    for q_start, q_len, ctx_len, blocks in batch.prefills:
        seg = PrefillSegment(q_start, q_len, ctx_len)
        fresh = blocks is None
        if not fresh:
            table = upload(torch.frombuffer(blocks, dtype=torch.int32).long(), device)
            seg.slots = _slots_of(table, ctx_len, block_size)
        if not fresh or (sliding_window and q_len > sliding_window):
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
            seg.mask = causal_mask(q_pos, ctx_len, sliding_window)[None, None]
        meta.prefills.append(seg)
    return meta


def carry_over(
    input_ids: torch.Tensor, carry: torch.Tensor, prev_tokens: torch.Tensor | None
) -> torch.Tensor:
    """Replace the placeholders of carried inputs (carry >= 0) by the previous step's tokens.

    Runs on the device with no branch on the data, so a CUDA graph can hold it.
    """
    if prev_tokens is None:
        return input_ids
    taken = prev_tokens[carry.clamp(min=0)]
    return torch.where(carry >= 0, taken, input_ids)
