"""Runs one scheduled step on the device: inputs in, forward, sample, tokens out.

The split into prepare (host) / execute (device) / fetch (host) is the seam the asynchronous
step loop uses to overlap the CPU's next batch with the device's current one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import HostBatch, build_attention_metadata, build_host_batch, carry_over
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
        self.decode_kernel = None  # DecodeKernel.for_batch where decodes read K/V in place
        if self.in_place_decode:
            from .triton_decode import DecodeKernel  # needs Triton: CUDA hosts only

            self.decode_kernel = DecodeKernel.for_batch
        self.stream: torch.cuda.Stream | None = None  # the asynchronous loop's stream, made on first use
        self.graphs = None
        if cuda_graphs and self.in_place_decode:
            from .cuda_graphs import DecodeGraphs

            max_blocks = -(-max_model_len // cache.block_size)
            self.graphs = DecodeGraphs(model, cache, max_num_seqs, max_blocks)

    def capture_graphs(self) -> None:
        """Capture the decode graphs (warm-up time, before the server reports SERVING)."""
        if self.graphs is not None:
            self.graphs.capture()

    def prepare(self, chunks: list[ScheduledChunk], prev_rows: dict[int, int] | None = None) -> HostBatch:
        return build_host_batch(chunks, self.block_size, pin=self.device.type == "cuda", prev_rows=prev_rows)

    @torch.inference_mode()
    def execute(self, batch: HostBatch, prev_tokens: torch.Tensor | None = None) -> SampleOutput:
        """Forward + sample. `prev_tokens`: the previous step's sampled tokens, for carried inputs."""
        dev = self.device
        if self.graphs is not None and self.graphs.fits(batch):
            return sample(self.graphs.run(batch, prev_tokens), batch.sampling.to(dev))
        kernel = None
        if self.decode_kernel is not None and batch.decode_token_idx:
            kernel = self.decode_kernel(self.cache, len(batch.decode_token_idx), self.num_sms)
        meta = build_attention_metadata(batch, self.block_size, dev, self.sliding_window, kernel)
        meta.kv_cache = self.cache
        input_ids = carry_over(batch.input_ids.to(dev, non_blocking=True), batch, prev_tokens)[None]
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

    def launch(self, chunks: list[ScheduledChunk], prev: LaunchedStep | None) -> LaunchedStep:
        """The asynchronous step: queue this step's work and return without waiting for it.

        Inputs the previous (still running) step samples are carried over on the device. On CUDA
        all work goes to one non-default stream, results are copied to pinned memory and an event
        marks their arrival; on CPU the step simply runs.
        """
        prev_rows = prev.rows if prev is not None else None
        batch = self.prepare(chunks, prev_rows)
        prev_tokens = prev.sampled.tokens if prev is not None else None
        if self.device.type != "cuda":
            out = self.execute(batch, prev_tokens)
            return LaunchedStep(batch, out, out, _rows(chunks, batch), None, None)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(self.stream)
            out = self.execute(batch, prev_tokens)
            parts = (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)
            host = SampleOutput(*(_to_host(t) for t in parts))
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        return LaunchedStep(batch, out, host, _rows(chunks, batch), done, begin)

    @staticmethod
    def wait(step: LaunchedStep) -> StepResult:
        """Block until the step's tokens are on the host: the one wait per step."""
        if step.done is not None:
            step.done.synchronize()
        return ModelRunner.fetch(step.batch, step.host)


@dataclass
class LaunchedStep:
    batch: HostBatch
    sampled: SampleOutput  # on the device: the next step carries tokens from here
    host: SampleOutput  # pinned host copies (the same tensors on CPU)
    rows: dict[int, int]  # id(sequence) -> its row in `sampled`
    done: torch.cuda.Event | None
    begin: torch.cuda.Event | None  # with `done`: the step's time on the stream, from event timestamps

    def device_seconds(self) -> float | None:
        """Time the step occupied its stream (call after `done` completed: no extra sync)."""
        if self.begin is None or self.done is None:
            return None
        return self.begin.elapsed_time(self.done) / 1e3


def _rows(chunks: list[ScheduledChunk], batch: HostBatch) -> dict[int, int]:
    return {id(chunks[ci].seq): row for row, ci in enumerate(batch.sample_chunks)}


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
