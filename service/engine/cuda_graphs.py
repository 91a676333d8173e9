"""CUDA graphs of the decode step: one per (slot, batch-size bucket, sampling kind), one pool.

A decode-only step stages its inputs in its slot's static buffers (padded up to the bucket) and
replays the graph captured for that slot and bucket: carry-over of tokens still in flight,
the forward, sampling, and the write of the sampled tokens into the slot, all in one launch.
Padding rows write their K/V into a scratch block that no sequence owns and attend to it alone.
Every graph draws from one shared memory pool, so a second slot costs its buffers, not a second
copy of the forward's activations.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .batch import carry_over, decode_metadata
from .forward import forward_and_sample
from .ops.deferred_rotary import DeferredRotary
from .ops.kv_cache import KVCache
from .step_buffers import StepBuffers

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [b for b in _BUCKETS if b < max_batch]
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[..., object],
        cache: KVCache,
        slots: list[StepBuffers],
        rotary: DeferredRotary | None = None,
    ) -> None:
        self.forward = forward  # the deferred model (or the model), or its torch.compile'd form
        self.rotary = rotary  # where the deferred model leaves the rotary embedding to the op
        self.cache = cache
        self.slots = slots
        self.buckets = buckets_up_to(slots[0].max_num_seqs)  # a bucket's rows fit in the slots
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        # per slot: the greedy graphs' logits, for samplers a graph does not hold (made at capture)
        self.logits: list[torch.Tensor | None] = [None] * len(slots)
        # start-up seconds: each shape's first run outside capture (the compiler's), the captures
        self.compile_s = 0.0
        self.capture_s = 0.0

    def bucket_for(self, num_decodes: int, has_prefill: bool) -> int | None:
        """Decode-only steps up to the largest bucket replay a graph; others run eagerly."""
        if has_prefill or num_decodes > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= num_decodes)

    def _step(self, s: int, b: int, sampled: bool) -> torch.Tensor:
        buf = self.slots[s]
        prev = self.slots[(s + 1) % len(self.slots)]  # the previous step ran in the other slot
        dev = buf.view(b, b, b, buf.max_blocks, all_greedy=not sampled)
        meta = decode_metadata(dev, self.cache, self.rotary)
        input_ids = carry_over(dev.input_ids, dev.carry, prev.tokens)
        return forward_and_sample(self.forward, input_ids, dev, meta, 0, buf.tokens[:b])[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so smaller graphs reuse its memory from the shared pool."""
        for buf in self.slots:  # every row starts as a padding row
            buf.pad_device_rows()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in reversed(self.buckets):
                for s in range(len(self.slots)):
                    for sampled in (False, True):
                        self._capture(s, b, sampled, side)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def _capture(self, s: int, b: int, sampled: bool, side: torch.cuda.Stream) -> None:
        start = time.perf_counter()
        logits = self._step(s, b, sampled)  # warm-up outside capture: compiles, plans
        side.synchronize()
        captured = time.perf_counter()
        self.compile_s += captured - start
        if self.logits[s] is None:
            self.logits[s] = logits.new_empty(self.buckets[-1], logits.shape[-1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            logits = self._step(s, b, sampled)
            if not sampled:
                self.logits[s][:b].copy_(logits)
        self.graphs[(s, b, sampled)] = graph
        self.capture_s += time.perf_counter() - captured

    def replay(self, s: int, b: int, n: int, sampled: bool) -> torch.Tensor:
        """Run the step of slot `s` in bucket `b`; -> logits of its `n` real rows (greedy kind)."""
        self.graphs[(s, b, sampled)].replay()
        return self.logits[s][:n]
