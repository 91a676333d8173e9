"""The paged KV cache: per layer, K and V as [num_blocks * block_size, kv_heads, head_dim].

Two memory layouts behind that one view (names as FlashInfer's): "NHD" stores each token's heads
together, [layer, slot, head, dim]; "HND" stores each head's tokens together, [layer, head, slot,
dim], so a cache block of one head is one contiguous run of memory (what the CUDA decode kernel
reads per program). `k` / `v` are always [layer, slot, head, dim] (a transposed view for HND), so
every torch path indexes the cache the same way; `k_store` / `v_store` are the storage itself.
"""

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


LAYOUTS = ("NHD", "HND")


def slot_major(store: torch.Tensor, head_major: bool) -> torch.Tensor:
    """[layer, slot, head, dim] view of a cache's storage in either layout."""
    return store.transpose(1, 2) if head_major else store


class KVCache:
    def __init__(
        self,
        shape: CacheShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: str = "NHD",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"KV-cache layout {layout!r}: expected one of {LAYOUTS}")
        self.shape, self.num_blocks, self.block_size, self.layout = shape, num_blocks, block_size, layout
        # one extra block no sequence owns: padding rows of a CUDA graph write and read it
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        heads, dim = shape.num_kv_heads, shape.head_dim
        layers = shape.num_layers
        dims = (layers, slots, heads, dim) if layout == "NHD" else (layers, heads, slots, dim)
        self.k_store = torch.zeros(dims, dtype=dtype, device=device)
        self.v_store = torch.zeros(dims, dtype=dtype, device=device)
        self.k = slot_major(self.k_store, self.head_major)
        self.v = slot_major(self.v_store, self.head_major)

    @property
    def head_major(self) -> bool:
        return self.layout == "HND"

    @staticmethod
    def blocks_for_budget(shape: CacheShape, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        return budget_bytes // (shape.bytes_per_token(dtype) * block_size)
