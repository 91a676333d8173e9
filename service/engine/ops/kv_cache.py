"""The paged KV cache: per layer, K and V as [num_blocks * block_size, kv_heads, head_dim].

Two memory layouts behind that one view (names as FlashInfer's): "NHD" stores each token's heads
together, [layer, slot, head, dim]; "HND" stores each head's tokens together, [layer, head, slot,
dim], so a cache block of one head is one contiguous run of memory (what the CUDA decode kernel
reads per program). `k` / `v` are always [layer, slot, head, dim] (a transposed view for HND), so
every torch path indexes the cache the same way; `k_store` / `v_store` are the storage itself.

The storage dtype is the model's ("auto") or e4m3 ("fp8": half the bytes per token, so twice the
tokens for the same memory), the latter with one float32 scale per layer for K and one for V
(`k_scale`, `v_scale`; kv_quant.py has the arithmetic). The scales are tensors on the device, set
in place (`set_scales`), so captured CUDA graphs and compiled steps read the values set later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_quant import is_fp8, storage_dtype


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
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`dtype`: the model's (what reads give back); `kv_cache_dtype`: "auto" or "fp8"."""
        if layout not in LAYOUTS:
            raise ValueError(f"KV-cache layout {layout!r}: expected one of {LAYOUTS}")
        self.shape, self.num_blocks, self.block_size, self.layout = shape, num_blocks, block_size, layout
        # one extra block no sequence owns: padding rows of a CUDA graph write and read it
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        heads, dim = shape.num_kv_heads, shape.head_dim
        layers = shape.num_layers
        dims = (layers, slots, heads, dim) if layout == "NHD" else (layers, heads, slots, dim)
        self.dtype = dtype
        self.storage_dtype = storage_dtype(kv_cache_dtype, dtype)
        self.k_store = torch.zeros(dims, dtype=self.storage_dtype, device=device)
        self.v_store = torch.zeros(dims, dtype=self.storage_dtype, device=device)
        self.k = slot_major(self.k_store, self.head_major)
        self.v = slot_major(self.v_store, self.head_major)
        # per layer; None for a cache in the model's dtype (nothing to scale)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if self.quantized:
            self.k_scale = torch.ones(layers, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(layers, dtype=torch.float32, device=device)

    @property
    def quantized(self) -> bool:
        return is_fp8(self.storage_dtype)

    def set_scales(self, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor) -> None:
        """Set the FP8 cache's scales: one value for every layer or one per layer ([num_layers]),
        e.g. a checkpoint's calibrated k_scale / v_scale. In place: graphs captured over the cache
        read the new values. Set before K/V are written: stored values are not rescaled."""
        if not self.quantized:
            raise ValueError("a KV cache in the model's dtype has no scales (kv_cache_dtype='auto')")
        for name, new, scales in (("k_scale", k_scale, self.k_scale), ("v_scale", v_scale, self.v_scale)):
            new = torch.as_tensor(new, dtype=torch.float32)
            if not (torch.isfinite(new).all() and (new > 0).all()):
                raise ValueError(f"{name} must be finite and positive, got {new.tolist()}")
            scales.copy_(new.expand_as(scales))

    @property
    def head_major(self) -> bool:
        return self.layout == "HND"

    @staticmethod
    def blocks_for_budget(shape: CacheShape, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        """`dtype`: the storage's (`storage_dtype`), not necessarily the model's."""
        return budget_bytes // (shape.bytes_per_token(dtype) * block_size)
