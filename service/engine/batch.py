"""Batch builder: turn a scheduler step into flat host tensors, then into device inputs.

All scheduled tokens are packed into one row ([1, T]) so prefill chunks and decodes of many
sequences run in one forward; the attention metadata tells each token where its K/V live.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .ops.attention_metadata import AttentionMetadata, PrefillSegment
from .ops.attention_ref import causal_mask, decode_mask
from .ops.deferred_rotary import DeferredRotary
from .ops.kv_cache import KVCache
from .ops.varlen_prefill import Stage, VarlenPrefill, upload
from .scheduler import ScheduledChunk


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
    decode_idx: torch.Tensor  # [B] packed index of each decode's token
    block_table: torch.Tensor  # [B, max_blocks] int32, decode rows
    ctx_lens: torch.Tensor  # [B] int32
    sampling: SamplingTensors


@dataclass
class HostBatch:
    """CPU tensors for one step (staged into a slot's pinned buffers on upload) and the result map."""

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


def build_host_batch(
    chunks: list[ScheduledChunk],
    block_size: int,
    prev_rows: dict[int, int] | None = None,
) -> HostBatch:
    """`prev_rows`: id(sequence) -> its row in the previous step's samples, for carried chunks.

    At 256 sequences this runs once per step on the host, inside the device's step time: a
    decode row costs a few scalar writes, a prompt chunk and the block table are array copies."""
    total = sum(c.num_tokens for c in chunks)
    input_ids = np.empty(total, np.int64)
    positions = np.empty(total, np.int64)
    slots = np.empty(total, np.int64)
    carry = np.full(total, -1, np.int64)
    carried = False
    logits_indices: list[int] = []
    sample_chunks: list[int] = []
    decode_idx: list[int] = []
    decode_tables: list[array] = []
    decode_lens: list[int] = []
    prefills: list[tuple[int, int, int, array | None]] = []
    temps, top_ps, top_ks, seeds, steps = [], [], [], [], []
    num_logprobs = -1

    q = 0  # the chunk's first row in the packed step
    for ci, chunk in enumerate(chunks):
        seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
        blocks = seq.block_ids
        if n == 1:
            input_ids[q] = 0 if chunk.carried else seq.token_ids[start]
            positions[q] = start
            slots[q] = blocks[start // block_size] * block_size + start % block_size
            decode_idx.append(q)
            decode_tables.append(blocks)
            decode_lens.append(start + 1)
        else:
            known = seq.token_ids[start : start + n]  # n tokens, or n - 1 with the last in flight
            input_ids[q : q + len(known)] = known
            positions[q : q + n] = np.arange(start, start + n)
            slots[q : q + n] = _chunk_slots(blocks, start, n, block_size)
            prefills.append((q, n, start + n, None if start == 0 else blocks[:]))
        if chunk.carried:  # its input is still on the device: placeholder + where to take it from
            input_ids[q + n - 1] = 0
            carry[q + n - 1] = prev_rows[id(seq)]
            carried = True
        if chunk.samples:
            p = seq.params
            logits_indices.append(q + n - 1)
            sample_chunks.append(ci)
            temps.append(p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(p.top_k)
            seeds.append(seq.seed)
            steps.append(seq.num_output + seq.num_inflight - 1)  # this token's index in the output
            if p.logprobs:
                num_logprobs = max(num_logprobs, p.top_logprobs)
        q += n

    sampling = SamplingTensors(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_p=torch.tensor(top_ps, dtype=torch.float32),
        top_k=torch.tensor(top_ks, dtype=torch.int64),
        seeds=torch.tensor(seeds, dtype=torch.int64),
        steps=torch.tensor(steps, dtype=torch.int64),
        all_greedy=all(t == 0.0 for t in temps),
        needs_filter=any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps),
        num_logprobs=num_logprobs,
    )
    return HostBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        sample_chunks=sample_chunks,
        decode_token_idx=decode_idx,
        decode_block_table=_block_table(decode_tables) if decode_tables else None,
        decode_ctx_lens=torch.tensor(decode_lens, dtype=torch.int64) if decode_tables else None,
        prefills=prefills,
        sampling=sampling,
        carry=torch.from_numpy(carry) if carried else None,
    )


def _chunk_slots(blocks: array, start: int, n: int, block_size: int) -> np.ndarray:
    """Cache slots of positions start .. start + n - 1 of a sequence with these blocks."""
    first, last = start // block_size, (start + n - 1) // block_size
    ids = np.array(blocks[first : last + 1], np.int64)
    offset = start % block_size
    return (ids[:, None] * block_size + np.arange(block_size)).ravel()[offset : offset + n]


def _block_table(tables: list[array]) -> torch.Tensor:
    """[rows, longest] int32: each row's block ids, then zeros (the kernels read a row up to its
    context length only)."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    table = np.zeros((len(tables), int(lens.max())), np.int32)
    table[np.arange(table.shape[1]) < lens[:, None]] = np.frombuffer(b"".join(tables), np.intc)
    return torch.from_numpy(table)


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
        decode_block_table=dev.block_table,
        decode_ctx_lens=dev.ctx_lens,
        rotary=rotary,
    )


def build_attention_metadata(
    batch: HostBatch,
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
            meta.decode_token_idx = dev.decode_idx
            meta.decode_block_table = dev.block_table
            meta.decode_ctx_lens = dev.ctx_lens
        else:
            # whole blocks are gathered (one copy per block, not per token); the mask hides the tail
            meta.decode_token_idx = dev.decode_idx
            meta.decode_blocks = dev.block_table.long().flatten()
            width = dev.block_table.shape[1] * block_size
            meta.decode_mask = decode_mask(dev.ctx_lens.long(), width, sliding_window)
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
