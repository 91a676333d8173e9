"""Runs one scheduled step on the device: inputs in, forward, sample, tokens out.

A step is launched, then waited for. On CUDA the launch queues three stages on three streams,
chained by events, and returns at once:

    h2d stream:      stage the slot's inputs, copy them to the device      -> h2d_done
    compute stream:  wait h2d_done; carry-over, forward, sample             -> compute_done
    d2h stream:      wait compute_done; copy the sampled tokens to the host -> d2h_done

Steps alternate between two slots of buffers, so the CPU fills one while the device reads the
other; `wait` blocks on d2h_done, the one host wait per step. On CPU the stages simply run.

A step with constrained rows (structured output) is launched without its sampling: the compute
stream runs the forward, and the host, meanwhile, fills the rows' token masks (grammar.py); then
`sample_masked` queues the masks' upload on the h2d stream and the sampling behind it (the compute
stream waits for that upload only), and the d2h copies as above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .batch import DeviceBatch, StepInputs, build_attention_metadata, carry_over
from .batch_builder import StepInputsBuilder
from .compile_scope import compile_forward
from .config import EngineConfig
from .forward import forward_and_sample, forward_logits
from .kv_offload import KVOffload
from .ops.decode_op import num_sms
from .ops.deferred_rotary import defer_rotary
from .ops.fp8_linear import compile_gemm_variants
from .ops.kv_cache import KVCache
from .sampler import PromptLogprobs, SampleOutput, mask_logits, sample
from .scheduler import BlockMoves, ScheduledChunk, SchedulerOutput
from .step_buffers import StepBuffers
from .streams import Streams, on


@dataclass
class StageEvents:
    """CUDA events around each stage of a step (timing-enabled: their gaps are the stage times)."""

    h2d_start: torch.cuda.Event
    h2d_done: torch.cuda.Event
    compute_start: torch.cuda.Event
    compute_done: torch.cuda.Event
    d2h_start: torch.cuda.Event
    d2h_done: torch.cuda.Event
    h2d_host: float = 0.0  # time.time() when h2d_start was recorded

    @classmethod
    def make(cls) -> StageEvents:
        return cls(*(torch.cuda.Event(enable_timing=True) for _ in range(6)))

    def intervals(self) -> dict[str, tuple[float, float]]:
        """Wall-clock (start, end) of each device stage (call once the step is done).

        `h2d_start` is recorded on the copy stream, idle between steps, so the device reaches it
        within microseconds of `h2d_host` (the host clock when it was recorded): every other
        event is placed relative to it, with no extra synchronisation and no clock drift.
        """

        def wall(event: torch.cuda.Event) -> float:
            return self.h2d_host + self.h2d_start.elapsed_time(event) / 1e3

        return {
            "h2d": (self.h2d_host, wall(self.h2d_done)),
            "compute": (wall(self.compute_start), wall(self.compute_done)),
            "d2h": (wall(self.d2h_start), wall(self.d2h_done)),
        }


@dataclass
class Unsampled:
    """A launched step's forward, whose sampling waits for its token masks (`sample_masked`)."""

    logits: torch.Tensor  # [S, V] its sampled rows', on the device
    prompt: PromptLogprobs[torch.Tensor] | None  # its prompt rows' logprobs (no mask applies to them)


@dataclass
class LaunchedStep:
    """A step queued on the device, whose tokens the host has not seen yet (or, in the synchronous
    loop, has): what it computes, its buffers, and when it was scheduled and launched."""

    out: SchedulerOutput  # what the scheduler gave it
    batch: StepInputs
    dev: DeviceBatch  # held until the step is done, so its buffers outlive the device's reads
    # on the device, held until the step is done (its copies read it); None while it is unsampled
    sampled: SampleOutput[torch.Tensor] | None
    host: SampleOutput[torch.Tensor] | None  # its host copies (pinned on CUDA)
    rows: dict[int, int]  # id(sequence) -> its row in the slot's sampled tokens
    slot: int
    graph_bucket: int | None
    scheduled: float  # host wall clock (time.time) when its scheduling began
    prepare: tuple[float, float]  # host wall clock of its batch build
    launched: float  # host monotonic clock when its launch began
    events: StageEvents | None  # CUDA only
    unsampled: Unsampled | None = None  # a constrained step's forward, until `sample_masked`
    mask: torch.Tensor | None = None  # its token masks on the device, held until the step is done

    def device_seconds(self) -> float | None:
        """Time the step occupied the compute stream (call once it is done: no extra sync)."""
        if self.events is None:
            return None
        return self.events.compute_start.elapsed_time(self.events.compute_done) / 1e3


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, config: EngineConfig) -> None:
        """`config`: resolved (core_builder.resolve): the runner reads its device paths as they are."""
        assert config.resolved, "an EngineConfig reaches the runner through core_builder.resolve"
        self.model = model
        self.cache = cache
        self.device = device = next(model.parameters()).device
        self.block_size = bs = cache.block_size
        self.sliding_window = sliding_window(model)
        self.num_sms = num_sms(device.index or 0) if config.in_place_decode else 0
        # prompt chunks of a step in one flash-attention call
        self.varlen_prefill = config.varlen_prefill
        self.decode_kernel = None  # DecodeKernel.for_batch where mixed steps read K/V in place
        if config.in_place_decode:
            from .ops.triton_decode import DecodeKernel  # needs Triton: CUDA hosts only

            self.decode_kernel = DecodeKernel.for_batch
        # steps run the deferred model: the model, but for its rotary embedding, which the
        # attention ops apply where the model family allows it (deferred_rotary.py)
        stepped, self.rotary = (
            defer_rotary(model, cache.shape.head_dim) if config.fold_rotary else (model, None)
        )
        # decode-only steps, compiled where asked: norms, activations and residuals fused around the op
        self.decode_forward = stepped
        if config.compile_decode or config.compile_prefill:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if config.compile_decode:
            self.decode_forward = compile_forward(stepped, config.compile_scope, config.compile_backend)
        # prefill and mixed steps, compiled where asked: one graph around the mixed attention op
        # (mixed_op.py), with a symbolic token count
        self.prefill_forward = stepped
        self.prefill_compiled = config.compile_prefill
        if config.compile_prefill:
            for store in (cache.k_store, cache.v_store):  # fixed: no guard ties them to the step's sizes
                torch._dynamo.mark_static(store)
            self.prefill_forward = compile_forward(stepped, config.compile_scope, config.compile_backend,
                                                   dynamic=True)
        max_blocks = -(-config.max_model_len // bs)
        self.slots = [
            StepBuffers(config.max_num_batched_tokens, config.max_num_seqs, max_blocks, device,
                        cache.scratch_block, bs)
            for _ in range(2)
        ]
        self._next_slot = 0
        self.inputs = StepInputsBuilder(bs)  # each step's inputs on the host
        self.streams = Streams(device) if device.type == "cuda" else None
        self.offload = None  # the host pool of preempted sequences' K/V (kv_offload.py)
        if config.kv_offload_blocks:
            self.offload = KVOffload(cache, config.kv_offload_blocks, self.streams)
        self.graphs = None
        if config.cuda_graphs:
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.decode_forward, cache, self.slots, self.rotary)

    def capture_graphs(self) -> dict[str, float]:
        """Capture the decode graphs and compile the mixed steps' decode kernels and the FP8 GEMMs'
        variants (warm-up time, before the server reports SERVING). -> seconds of each part: the
        start-up's `compile` phase is the sum of those but `graph_capture` (start_up_phases)."""
        start = time.perf_counter()
        if self.decode_kernel is not None:
            from .ops.triton_decode import compile_step_variants

            heads = self.model.config.get_text_config().num_attention_heads
            cache = self.cache
            scales = (cache.k_scale[0], cache.v_scale[0]) if cache.quantized else None
            compile_step_variants(cache.k[0], cache.v[0], self.block_size, heads, self.slots[0].max_blocks,
                                  cache.dtype, scales)
        variants = time.perf_counter()
        compile_gemm_variants(self.model)  # the FP8 layers' Triton GEMMs (CUDA) at every row count
        seconds = {
            "decode_kernel_variants": variants - start,
            "fp8_gemm_variants": time.perf_counter() - variants,
            "decode_forwards": 0.0,
            "graph_capture": 0.0,
        }
        if self.graphs is not None:
            self.graphs.capture()
            seconds["decode_forwards"] = self.graphs.compile_s
            seconds["graph_capture"] = self.graphs.capture_s
        return seconds

    def move_blocks(self, moves: BlockMoves) -> None:
        """Queue a step's K/V copies to and from the host pool, ahead of its forward."""
        assert self.offload is not None, "the scheduler offloads only with a host pool"
        self.offload.queue(moves)

    def prepare(self, chunks: list[ScheduledChunk], prev_rows: dict[int, int] | None = None) -> StepInputs:
        return self.inputs.build(chunks, prev_rows)

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, prev: LaunchedStep | None, scheduled: float, constrained: bool = False
    ) -> LaunchedStep:
        """Queue one step and return without waiting for the device.

        `prev`: the step still in flight; inputs it samples are carried over on the device from
        its slot's token buffer. `scheduled`: when the step's scheduling began (wall clock).
        `constrained`: some sampled row has a grammar: only the forward is queued, and the step is
        sampled by `sample_masked` once the host has its masks.
        """
        launched = time.monotonic()
        chunks = out.chunks
        started = time.time()
        batch = self.prepare(chunks, prev.rows if prev is not None else None)
        prepared = time.time()
        s = self._next_slot
        self._next_slot = 1 - s
        buf = self.slots[s]
        prev_tokens = self.slots[prev.slot].tokens if prev is not None else None
        bucket = None
        if self.graphs is not None and batch.prompt is None:  # prompt logprobs: the eager step
            bucket = self.graphs.bucket_for(len(batch.decode_token_idx), bool(batch.prefills))
        st = self.streams
        ev = StageEvents.make() if st is not None else None
        with on(st and st.h2d):
            if ev is not None:
                ev.h2d_host = time.time()
                ev.h2d_start.record()
            dev = buf.upload(batch, bucket)
            if ev is not None:
                ev.h2d_done.record()
        with on(st and st.compute):
            if ev is not None:
                st.compute.wait_event(ev.h2d_done)
                ev.compute_start.record()
            computed = self._compute(batch, dev, s, bucket, prev_tokens, constrained)
        rows = {id(chunks[ci].seq): row for row, ci in enumerate(batch.sample_chunks)}
        step = LaunchedStep(out, batch, dev, None, None, rows, s, bucket, scheduled, (started, prepared),
                            launched, ev)
        if isinstance(computed, Unsampled):
            step.unsampled = computed
        else:
            self._copy_out(step, computed)
        return step

    @torch.inference_mode()
    def sample_masked(self, step: LaunchedStep, mask: torch.Tensor) -> None:
        """Sample a constrained step (launched with `constrained`), its rows' logits masked by `mask`
        ([S, ceil(V / 32)] int32 on the host, pinned on CUDA: grammar.Grammars.fill); then queue
        its copies to the host as `launch` does for any other step."""
        unsampled, step.unsampled = step.unsampled, None
        assert unsampled is not None, "sample_masked takes a step launched with constrained=True"
        st = self.streams
        with on(st and st.h2d):
            mask_dev = mask.to(self.device, non_blocking=True)
            uploaded = torch.cuda.Event() if st is not None else None
            if uploaded is not None:
                uploaded.record()
        with on(st and st.compute):
            if uploaded is not None:
                st.compute.wait_event(uploaded)
            sampled = sample(mask_logits(unsampled.logits, mask_dev), step.dev.sampling)
            self.slots[step.slot].tokens[: len(sampled.tokens)].copy_(sampled.tokens)
            sampled.prompt = unsampled.prompt
            step.mask = mask_dev  # held until the step is done: the device reads it
        self._copy_out(step, sampled)

    def _copy_out(self, step: LaunchedStep, sampled: SampleOutput[torch.Tensor]) -> None:
        """The end of a step's compute stage, and its sampled rows' copies to the host."""
        st, ev, buf, n = self.streams, step.events, self.slots[step.slot], len(step.batch.sample_chunks)
        if ev is not None:
            with on(st.compute):
                ev.compute_done.record()
        with on(st and st.d2h):
            if ev is not None:
                st.d2h.wait_event(ev.compute_done)
                ev.d2h_start.record()
            step.host = SampleOutput(
                buf.tokens_host[:n].copy_(buf.tokens[:n], non_blocking=True),
                _to_host(sampled.logprobs), _to_host(sampled.top_ids), _to_host(sampled.top_logprobs),
                None if sampled.prompt is None else sampled.prompt.map(_to_host),
            )
            if ev is not None:
                ev.d2h_done.record()
        step.sampled = sampled

    def _compute(
        self, batch: StepInputs, dev: DeviceBatch, s: int, bucket: int | None,
        prev_tokens: torch.Tensor | None, constrained: bool = False,
    ) -> SampleOutput[torch.Tensor] | Unsampled:
        """Forward + sample on the current stream; the sampled tokens land in slot `s`. A
        `constrained` step: the forward alone."""
        tokens = self.slots[s].tokens[: len(batch.sample_chunks)]
        st = dev.sampling
        if bucket is not None:  # the graph carries over, samples and writes the slot's tokens itself
            in_graph = not st.needs_filter and st.num_logprobs < 0 and not constrained
            logits = self.graphs.replay(s, bucket, len(tokens), sampled=in_graph and not st.all_greedy)
            if in_graph:
                return SampleOutput(tokens)
            if constrained:
                return Unsampled(logits, None)
            out = sample(logits, st)  # top-k / top-p / logprobs: on the greedy graph's logits
            tokens.copy_(out.tokens)
            return out
        kernel = None
        if self.decode_kernel is not None and batch.decode_token_idx:
            longest = int(batch.decode_ctx_lens.max())  # the host knows it: the grid fits the step
            kernel = self.decode_kernel(self.cache, len(batch.decode_token_idx), self.num_sms, longest)
        meta = build_attention_metadata(
            batch, dev, self.cache, self.sliding_window, kernel,
            varlen=self.slots[s].stage if self.varlen_prefill else None, rotary=self.rotary,
        )
        input_ids = carry_over(dev.input_ids, dev.carry, prev_tokens)
        if input_ids is not dev.input_ids:  # in the slot's buffer, as without carries: one kind of
            input_ids = dev.input_ids.copy_(input_ids)  # tensor for the compiled forward's guards
        keep = 0 if meta.decode_only else dev.logits_indices
        prompt = batch.prompt
        if prompt is not None:  # the sampled rows' logits, then the prompt rows' (sampler.prompt_logprobs)
            keep = torch.cat([dev.logits_indices, prompt.indices.to(self.device, non_blocking=True)])
            if self.prefill_compiled and len(keep) < 2:  # 1 row: a size the compiler specialises on
                keep = keep.repeat(2)  # (as below); the repeated row is past those read
        elif self.prefill_compiled and not meta.decode_only and len(keep) < 2:
            # 0 and 1 rows are sizes the compiler specialises on: pad to 2 (row 0, dropped
            # below) so that no step with one prompt or none sampling compiles another graph;
            # padded in the slot's own buffer, so the tensor is of the same kind as unpadded ones
            keep = self.slots[s].padded_logits_indices(len(keep), 2)
        forward = self.decode_forward if meta.decode_only else self.prefill_forward
        if constrained:
            return Unsampled(*forward_logits(forward, input_ids, dev, meta, keep, len(tokens), prompt))
        return forward_and_sample(forward, input_ids, dev, meta, keep, tokens, prompt)[1]

    @staticmethod
    def wait(step: LaunchedStep) -> SampleOutput[list]:
        """Block until the step's tokens are on the host (the one wait per step); its sampled rows,
        in the order of `step.batch.sample_chunks`."""
        if step.host is None:
            raise RuntimeError("the step was never sampled (its masks were not filled)")
        if step.events is not None:
            step.events.d2h_done.synchronize()
        return step.host.tolist()


def sliding_window(model: torch.nn.Module) -> int | None:
    """The model's attention window, where it uses one (None: every layer sees the whole context)."""
    text_config = model.config.get_text_config()
    if not getattr(text_config, "use_sliding_window", True):
        return None
    return getattr(text_config, "sliding_window", None)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
