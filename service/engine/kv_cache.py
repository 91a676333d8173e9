"""The paged KV cache: per layer, K and V as [num_blocks * block_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: object) -> CacheShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


class KVCache:
    def __init__(
        self, shape: CacheShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        # one extra block no sequence owns: padding rows of a CUDA graph write and read it
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        dims = (shape.num_layers, slots, shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)

    @staticmethod
    def blocks_for_budget(shape: CacheShape, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        return budget_bytes // (shape.bytes_per_token(dtype) * block_size)
