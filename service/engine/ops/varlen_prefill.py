"""All prompt chunks of a step in one flash-attention call per layer (CUDA).

The reference path attends each prompt chunk with its own SDPA call: 32 prompts of an 8B step make
1,024 small launches and their copies, milliseconds of GPU and tens of milliseconds of Python. Here
each layer gathers the chunks' context K/V from the paged cache (their new K/V are already written
there) into one packed tensor and runs FlashAttention-2's variable-length kernel over all of them,
causal from the bottom right, so a chunk that continues a cached prefix sees that prefix too.
An FP8 cache's K/V are gathered as stored (half the bytes) and dequantized to the queries' dtype for
the kernel, which takes 16-bit inputs only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kv_quant import read, select

Stage = Callable[[str, torch.Tensor], torch.Tensor]  # StepBuffers.stage: (name, host tensor) -> on the device


@dataclass
class VarlenPrefill:
    """A step's prompt chunks, packed: queries by batch index, keys by cache slot."""

    q_index: torch.Tensor  # [Tq] int64 packed index of every chunk's query tokens, chunk by chunk
    kv_slots: torch.Tensor  # [Tk] int64 cache slot of every chunk's context, chunk by chunk
    cu_q: torch.Tensor  # [n + 1] int32 offsets of each chunk's queries in q_index
    cu_k: torch.Tensor  # [n + 1] int32 offsets of each chunk's context in kv_slots
    max_q: int
    max_k: int

    @classmethod
    def build(cls, segments: list[tuple[int, int, torch.Tensor]], stage: Stage) -> VarlenPrefill:
        """`segments`: (q_start, q_len, context slots [ctx_len] on the host) of each chunk; `stage`
        puts the indexes and offsets on the device (through the step's slot)."""
        q_index = torch.cat([torch.arange(s, s + n) for s, n, _ in segments])
        kv_slots = torch.cat([slots for _, _, slots in segments])
        q_lens = [n for _, n, _ in segments]
        k_lens = [len(slots) for _, _, slots in segments]
        lens = torch.tensor([[0, 0], *zip(q_lens, k_lens, strict=True)], dtype=torch.int32)
        cu = lens.cumsum(0, dtype=torch.int32)  # the kernel takes int32 offsets only
        on_device = stage("varlen_index", torch.cat([q_index, kv_slots]))
        cu = stage("varlen_offsets", cu.t().contiguous())
        return cls(on_device[: len(q_index)], on_device[len(q_index) :], cu[0], cu[1], max(q_lens),
                   max(k_lens))

    def attend(
        self, qp: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """qp [Tq, H, D]: the chunks' queries, packed in `q_index`'s order -> their outputs.
        `k_scale`, `v_scale` (0-d): the layer's, for an FP8 cache."""
        kp = read(select(k_cache, self.kv_slots), k_scale, qp.dtype)
        vp = read(select(v_cache, self.kv_slots), v_scale, qp.dtype)
        return flash_varlen(qp.contiguous(), kp, vp, self.cu_q, self.cu_k, self.max_q, self.max_k, scale)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto the device, queued on the current stream. Through pinned memory
    on CUDA: the host itself stages a copy from pageable memory before the call returns."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float,
) -> torch.Tensor:
    """PyTorch's bundled FlashAttention-2, variable-length and causal (bottom-right aligned);
    grouped-query K/V are read as they are. The aten op, whose signature has held since
    PyTorch 2.3, where the public wrapper (torch.nn.attention.varlen) still changes."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )
    return out[0]


def varlen_supported(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
                     ) -> bool:
    """Whether this PyTorch and device run the kernel for this model: tried once, on a tiny input."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        q = torch.zeros(3, heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(3, kv_heads, head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
        flash_varlen(q, k, k, cu, cu, 2, 2, 1.0)
        torch.cuda.synchronize(device)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return False
    return True
