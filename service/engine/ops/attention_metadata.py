"""What a step's attention reads besides Q/K/V: where each token's K/V go, the decode rows'
block tables and context lengths, the prompt chunks. The batch builder (engine/batch.py) fills it;
the attention ops read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .deferred_rotary import DeferredRotary
from .varlen_prefill import VarlenPrefill


@dataclass
class PrefillSegment:
    """A run of query tokens of one sequence (a prompt chunk, or a recompute)."""

    q_start: int  # index of its first token in the packed batch
    q_len: int
    ctx_len: int  # keys it attends to: positions [0, ctx_len)
    slots: torch.Tensor | None = None  # [ctx_len] cache slots; None = fresh prompt, use its own K/V
    mask: torch.Tensor | None = None  # [1, 1, q_len, ctx_len] bool; None = plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_token_idx: torch.Tensor | None = None  # [B] packed index of each single-token query
    decode_blocks: torch.Tensor | None = None  # [B * W] cache blocks of each decode's context
    decode_mask: torch.Tensor | None = None  # [B, W * block_size] True = attend
    block_size: int = 0
    prefills: list[PrefillSegment] = field(default_factory=list)
    kv_cache: object = None  # the runner's KVCache, set before the forward
    # CUDA: decodes read K/V in place through their block tables (no decode_blocks / decode_mask)
    decode_kernel: Callable[..., torch.Tensor] | None = None
    decode_block_table: torch.Tensor | None = None  # [B, max_blocks] int32
    decode_ctx_lens: torch.Tensor | None = None  # [B] int32
    # no prefills: every token is a decode, rows in order (the decode op, CUDA graphs, compile)
    decode_only: bool = False
    # the deferred model's steps: Q and K come unrotated, the attention ops rotate them (decode
    # rows at their context length - 1, a step with prompts at `positions`)
    rotary: DeferredRotary | None = None
    positions: torch.Tensor | None = None  # [T] each token's position: a step with prompts, with `rotary`
    # CUDA: every prompt chunk in one variable-length flash-attention call (then `prefills` is empty)
    varlen: VarlenPrefill | None = None
    # a step with prompts whose decode rows are its first rows (the prompt chunks follow, in order,
    # as the scheduler orders them): each part's queries and outputs are then slices of the step's
    num_decode_first: int | None = None
