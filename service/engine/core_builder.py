"""Wire an engine core around a model: cache, blocks, scheduler, runner (no settings, no server).

The server's factory, the benchmarks and the tests all build their cores here, so this is also
where a config's "auto" and device-dependent choices are settled (`resolve`), once for all of them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from ..contract import Request, SamplingParams, StepTiming
from .block_manager import BlockManager
from .compile_scope import scope_for
from .config import EngineConfig
from .engine_core import EngineCore
from .host_blocks import HostBlocks
from .model_runner import ModelRunner, sliding_window
from .ops.attention import register
from .ops.decode_op import kernel_supports
from .ops.fp8_linear import compute_dtype, quantize_linears
from .ops.fp8_mlp import fuse_fp8_mlps
from .ops.fused_projections import fuse_projections
from .ops.kv_cache import CacheShape, KVCache
from .ops.kv_quant import storage_dtype
from .ops.varlen_prefill import varlen_supported
from .scheduler import Scheduler

log = logging.getLogger(__name__)


def build_core(
    model: torch.nn.Module,
    config: EngineConfig,
    eos_token_ids: frozenset[int] = frozenset(),
    step_observer: Callable[[StepTiming], None] | None = None,
    host_pool_in_background: bool = False,
) -> EngineCore:
    """`step_observer` sees every step, the compile warm-up's included (the engine process drops
    the timings of its warm-ups: they are not traffic). `host_pool_in_background`: the KV offload
    pool is allocated on a thread once the graphs are captured, and opens when it is there (the
    server: seconds off its start), rather than before the core is returned."""
    model.set_attn_implementation(register())
    if config.fuse_projections:
        log.info("fused %d groups of projections", fuse_projections(model))
    if config.quantization == "fp8":  # after fusing: the fused layers quantize as one
        log.info("quantized %d linear layers to FP8 (W8A8)", quantize_linears(model))
    elif config.quantization is not None:
        raise ValueError(f"quantization {config.quantization!r}: expected fp8 or none")
    mlps = fuse_fp8_mlps(model)  # FP8 layers quantized here or loaded from an FP8 checkpoint
    if mlps:
        log.info("%d gated MLPs quantize their activation in one kernel", mlps)
    device = next(model.parameters()).device
    dtype = compute_dtype(model)
    if device.type == "cuda":  # process-wide choices of PyTorch's CUDA backends
        torch.backends.cuda.preferred_blas_library(config.blas_library)
        # cuDNN's SDPA builds a plan per new shape; prompt lengths change every step, so the
        # planning (milliseconds of CPU) would cost more than the attention itself
        torch.backends.cuda.enable_cudnn_sdp(False)
    config = resolve(config, model)
    shape = CacheShape.of(model.config)
    kv_dtype = storage_dtype(config.kv_cache_dtype, dtype)
    log.info(
        "KV cache: %d blocks x %d tokens of %s (%.2f GiB), context length %d",
        config.num_blocks,
        config.block_size,
        str(kv_dtype).removeprefix("torch."),
        config.num_blocks * config.block_size * shape.bytes_per_token(kv_dtype) / 2**30,
        config.max_model_len,
    )
    if config.kv_offload_blocks:
        log.info(
            "KV offload: a host pool of %d blocks (%.2f GiB) for preempted sequences",
            config.kv_offload_blocks,
            config.kv_offload_blocks * config.block_size * shape.bytes_per_token(kv_dtype) / 2**30,
        )
    start = time.perf_counter()
    cache = KVCache(shape, config.num_blocks, config.block_size, dtype, device, config.kv_cache_layout,
                    config.kv_cache_dtype)
    allocated = time.perf_counter()
    # its host pool opens once the pool's memory is there (EngineCore): never, if it cannot be had
    scheduler = build_scheduler(config, model, host_pool_open=False)
    runner = ModelRunner(model, cache, config)
    # the start-up's kv_cache phase, part by part
    log.info("KV cache allocated in %.2f s; scheduler and runner (step buffers) in %.2f s",
             allocated - start, time.perf_counter() - allocated)
    parts = runner.capture_graphs()  # at start-up, before the server reports SERVING
    if runner.offload is not None:  # no capture from here on: another thread may allocate
        runner.offload.allocate(background=host_pool_in_background)
    core = EngineCore(runner, scheduler, config, eos_token_ids, step_observer)
    parts["prefill_shapes"] = 0.0
    if config.compile_prefill:
        start = time.perf_counter()
        compile_prefill_shapes(core)
        parts["prefill_shapes"] = time.perf_counter() - start
    core.start_up_seconds = start_up_phases(parts)
    # the start-up's compile phase, part by part
    log.info("compiled in %.2f s: %s", core.start_up_seconds["compile"],
             ", ".join(f"{COMPILE_PARTS[k]} {v:.2f} s" for k, v in parts.items() if k in COMPILE_PARTS))
    return core


# what the start-up's compile phase holds (ModelRunner.capture_graphs, compile_prefill_shapes)
COMPILE_PARTS = {
    "decode_kernel_variants": "mixed steps' decode-kernel variants",
    "fp8_gemm_variants": "FP8 GEMM variants",
    "decode_forwards": "decode forwards",
    "prefill_shapes": "prefill and mixed shapes",
}


def start_up_phases(parts: dict[str, float]) -> dict[str, float]:
    """The build's parts as the start-up's phases: graph capture, and the compile (all the rest)."""
    capture = parts.get("graph_capture", 0.0)
    return {"compile": sum(parts.values()) - capture, "graph_capture": capture}


def resolve(config: EngineConfig, model: torch.nn.Module) -> EngineConfig:
    """`config` with what it leaves to the device and the model settled, once: the step loop
    ("auto": asynchronous on CUDA), the context length (the model's unless set, capped by what
    the cache holds), the compile scope (the layer only where the model has decoder layers), and the
    device paths, each on only where asked and where it can run.

    An FP8 KV cache ("fp8") runs on any device: on CUDA through the Triton kernels (e4m3 needs
    compute capability 8.9, Ada or Hopper), on the CPU emulated by casts (kv_quant.py), which exists
    for tests and parity with the GPU, not for speed."""
    device = next(model.parameters()).device
    dtype = compute_dtype(model)
    storage_dtype(config.kv_cache_dtype, dtype)  # an unknown value: a ValueError naming the known ones
    if config.kv_cache_dtype == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype 'fp8' needs a GPU of compute capability 8.9 or later (Ada, Hopper): "
                f"this one has {capability[0]}.{capability[1]}; use 'auto'"
            )
    text_config = model.config.get_text_config()
    shape = CacheShape.of(model.config)
    capacity = config.num_blocks * config.block_size
    model_len = config.max_model_len or getattr(text_config, "max_position_embeddings", None)
    max_model_len = min(model_len or capacity, capacity)
    if max_model_len < 2:
        raise ValueError(f"the KV cache holds {capacity} tokens: too small to serve anything")
    cuda = device.type == "cuda"
    window = sliding_window(model)
    in_place_decode = (
        config.in_place_decode and cuda and not window and kernel_supports(config.block_size, shape.head_dim)
    )
    heads = text_config.num_attention_heads
    varlen_prefill = (
        config.varlen_prefill
        and not window
        and varlen_supported(device, dtype, heads, shape.num_kv_heads, shape.head_dim)
    )
    step_loop = config.step_loop
    if step_loop == "auto":
        step_loop = "async" if cuda else "sync"
    return dataclasses.replace(
        config,
        step_loop=step_loop,
        compile_scope=scope_for(config.compile_scope, model),
        max_model_len=max_model_len,
        in_place_decode=in_place_decode,
        varlen_prefill=varlen_prefill,
        cuda_graphs=config.cuda_graphs and in_place_decode,  # the graphs replay the in-place decode
        resolved=True,
    )


def build_scheduler(config: EngineConfig, model: torch.nn.Module, host_pool_open: bool = True) -> Scheduler:
    """The scheduler of `config` (its blocks, prefix caching, host pool) for `model`'s cache; its
    host pool closed until the engine core opens it where `host_pool_open` is False."""
    return Scheduler(
        BlockManager(config.num_blocks, config.block_size, config.prefix_caching,
                     _cache_salt(model, config.kv_cache_dtype)),
        config.max_num_seqs,
        config.max_num_batched_tokens,
        HostBlocks(config.kv_offload_blocks, host_pool_open) if config.kv_offload_blocks else None,
    )


def compile_prefill_shapes(core: EngineCore) -> None:
    """Compile the prefill forward at start-up rather than on the first requests: one step of two
    prompts, whose graph (symbolic token count) every later prefill and mixed step reuses. A step
    with prompts has at least 2 tokens (a one-token prompt is a decode), and the runner pads the
    sampled rows to at least 2, so no size the compiler specialises on (0, 1) comes later."""
    if core.max_model_len < 4:  # no room for a 3-token prompt and its token: a test-sized cache
        return
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate([[0, 0], [0, 0, 0]]):
        core.add(Request(f"compile-prefill-{i}", prompt, params))
    while core.scheduler.has_work:
        core.step()


def _cache_salt(model: torch.nn.Module, kv_cache_dtype: str) -> str:
    """What names the model and its K/V's dtype in the prefix cache's digests: K/V of one model
    are not another's, nor are K/V stored in FP8 those stored in the model's dtype."""
    config = model.config
    name = getattr(config, "_name_or_path", "")
    return f"{name}:{config.model_type}:{compute_dtype(model)}:kv-{kv_cache_dtype}"
