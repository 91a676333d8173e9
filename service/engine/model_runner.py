"""Runs one scheduled step on the device: inputs in, forward, sample, tokens out.

The split into prepare (host) / execute (device) / fetch (host) is the seam the asynchronous
step loop uses to overlap the CPU's next batch with the device's current one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import HostBatch, build_attention_metadata, build_host_batch
from .kv_cache import KVCache
from .sampler import SampleOutput, sample
from .scheduler import ScheduledChunk


@dataclass
class StepResult:
    """Host-side results of one step, one row per sampling sequence."""

    sample_chunks: list[int]
    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        device: torch.device,
        cuda_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        text_config = model.config.get_text_config()
        self.sliding_window = (
            getattr(text_config, "sliding_window", None)
            if getattr(text_config, "use_sliding_window", True)
            else None
        )
        self.vocab_size = text_config.vocab_size
        if device.type == "cuda":
            # cuDNN's SDPA builds a plan per new shape; prompt lengths change every step, so the
            # planning (milliseconds of CPU) would cost more than the attention itself
            torch.backends.cuda.enable_cudnn_sdp(False)
        # CUDA decodes read K/V in place with the Triton kernel: no sliding window, and cache
        # blocks of at least 16 tokens (a power of two) for its matrix tiles
        bs = cache.block_size
        self.in_place_decode = (
            device.type == "cuda" and not self.sliding_window and bs >= 16 and bs & (bs - 1) == 0
        )
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        )
        self.graphs = None
        if cuda_graphs and self.in_place_decode:
            from .cuda_graphs import DecodeGraphs

            max_blocks = -(-max_model_len // cache.block_size)
            self.graphs = DecodeGraphs(model, cache, max_num_seqs, max_blocks)

    def capture_graphs(self) -> None:
        """Capture the decode graphs (warm-up time, before the server reports SERVING)."""
        if self.graphs is not None:
            self.graphs.capture()

    def prepare(self, chunks: list[ScheduledChunk]) -> HostBatch:
        return build_host_batch(chunks, self.block_size, pin=self.device.type == "cuda")

    @torch.inference_mode()
    def execute(self, batch: HostBatch) -> SampleOutput:
        dev = self.device
        if self.graphs is not None and self.graphs.fits(batch):
            return sample(self.graphs.run(batch), batch.sampling.to(dev))
        kernel = None
        if self.in_place_decode and batch.decode_token_idx:
            from .triton_decode import DecodeKernel

            kernel = DecodeKernel.for_batch(self.cache, len(batch.decode_token_idx), self.num_sms)
        meta = build_attention_metadata(batch, self.block_size, dev, self.sliding_window, kernel)
        meta.kv_cache = self.cache
        input_ids = batch.input_ids.to(dev, non_blocking=True)[None]
        positions = batch.positions.to(dev, non_blocking=True)[None]
        logits_indices = batch.logits_indices.to(dev, non_blocking=True)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            logits_to_keep=logits_indices,
            use_cache=False,
            tandem_meta=meta,
        )
        return sample(out.logits[0], batch.sampling.to(dev))

    @staticmethod
    def fetch(batch: HostBatch, out: SampleOutput) -> StepResult:
        result = StepResult(batch.sample_chunks, out.tokens.tolist())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.tolist()
            if out.top_ids is not None:
                ids, lps = out.top_ids.tolist(), out.top_logprobs.tolist()
                result.top = [list(zip(i, lp, strict=True)) for i, lp in zip(ids, lps, strict=True)]
        return result

    def run(self, chunks: list[ScheduledChunk]) -> StepResult:
        """The synchronous step: prepare -> H2D -> forward + sample -> D2H -> wait."""
        batch = self.prepare(chunks)
        return self.fetch(batch, self.execute(batch))
