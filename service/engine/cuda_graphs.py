"""CUDA graphs of the decode forward: one per batch-size bucket, all in one memory pool.

A decode-only step copies its inputs into static buffers (padded up to the bucket) and replays
the graph captured for that bucket, so the thousand-odd kernels of a forward cost one launch.
Padding rows write their K/V into a scratch block that no sequence owns and attend to it alone.
"""

from __future__ import annotations

import torch

from .batch import AttentionMetadata, HostBatch, carry_over
from .kv_cache import KVCache
from .triton_decode import DecodeKernel

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [b for b in _BUCKETS if b < max_batch]
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, cache: KVCache, max_batch: int, max_blocks_per_seq: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.buckets = buckets_up_to(max_batch)
        dev = cache.k.device
        size = self.buckets[-1]
        self.scratch_slot = cache.scratch_block * cache.block_size
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((size,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.block_table = torch.full(
            (size, max_blocks_per_seq), cache.scratch_block, dtype=torch.int32, device=dev
        )
        self.ctx_lens = torch.ones(size, dtype=torch.int32, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            decode_token_idx=torch.arange(b, device=self.input_ids.device),
            decode_kernel=DecodeKernel.for_batch(self.cache, b, self.sms),
            decode_block_table=self.block_table[:b],
            decode_ctx_lens=self.ctx_lens[:b],
            kv_cache=self.cache,
        )
        out = self.model(
            input_ids=self.input_ids[None, :b],
            position_ids=self.positions[None, :b],
            logits_to_keep=0,
            use_cache=False,
            tandem_meta=meta,
        )
        return out.logits[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so smaller graphs reuse its memory from the shared pool."""
        for b in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: Triton compiles, cuBLAS plans
                self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def fits(self, batch: HostBatch) -> bool:
        """Decode-only steps up to the largest bucket replay a graph; others run eagerly."""
        return not batch.prefills and len(batch.decode_token_idx) <= self.buckets[-1]

    def run(self, batch: HostBatch, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        n = len(batch.decode_token_idx)
        b = next(x for x in self.buckets if x >= n)
        width = batch.decode_block_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        if batch.carry is not None:
            self.input_ids[:n].copy_(carry_over(self.input_ids[:n], batch, prev_tokens))
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.block_table[:n, :width].copy_(batch.decode_block_table, non_blocking=True)
        self.ctx_lens[:n].copy_(batch.decode_ctx_lens, non_blocking=True)
        if b > n:  # padding rows: scratch slot, one token of context
            self.slot_mapping[n:b].fill_(self.scratch_slot)
            self.block_table[n:b, 0].fill_(self.cache.scratch_block)
            self.ctx_lens[n:b].fill_(1)
        self.graphs[b].replay()
        return self.logits[b][:n]
