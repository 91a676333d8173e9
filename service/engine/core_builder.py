"""Wire an engine core around a model: cache, blocks, scheduler, runner (no settings, no server).

The server's factory, the benchmarks and the tests all build their cores here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .engine_core import EngineCore
from .host_blocks import HostBlocks
from .model_runner import ModelRunner
from .ops.attention import register
from .ops.fused_projections import fuse_projections
from .ops.kv_cache import CacheShape, KVCache
from .sampling_params import GenerationRequest, SamplingParams
from .scheduler import Scheduler
from .timing import StepTiming

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's, capped by what the cache holds
    cuda_graphs: bool = True  # CUDA only: decode steps replay captured graphs
    step_loop: str = "auto"  # "sync" | "async" | "auto" (async on CUDA, sync on CPU)
    # Q/K/V and gate/up as one GEMM each (changes the model in place). The server turns it on for
    # CUDA (0.5 ms of an 8B step at batch 32 on the H200); on the CPU it is no faster
    fuse_projections: bool = False
    # "NHD" (each token's heads together) or "HND" (each head's tokens together): kv_cache.py
    kv_layout: str = "NHD"
    compile_decode: bool = False  # decode-only steps run a torch.compile'd forward
    compile_backend: str = "inductor"  # tests use "aot_eager": same tracing, no code generation
    # CUDA: the library PyTorch's GEMMs prefer ("default" = PyTorch's own pick, "cublas", "cublaslt");
    # a process-wide choice (torch.backends.cuda.preferred_blas_library), made when the core is built
    blas_library: str = "default"
    # decode steps: the decode attention op applies the rotary embedding to Q and K as it loads them,
    # instead of two element-wise kernels per layer (deferred_rotary.py; where the model allows).
    # The server turns it on for CUDA (0.17 ms of an 8B step at batch 32 on the H200); on the CPU
    # the op's eager rotation shows no gain (SmolLM2: within run-to-run noise, docs/architecture.md)
    fold_rotary: bool = False
    # prefill and mixed steps run a torch.compile'd forward too (symbolic token count, one graph
    # around the mixed attention op), compiled at start-up by a short warm-up. The server turns it on for CUDA
    compile_prefill: bool = False
    idle_window_s: float = 60.0  # the sliding window of the engine's idle fraction
    # full KV blocks stay cached for later requests with the same prefix (block_manager.py); the
    # server turns it on (TANDEM_PREFIX_CACHING)
    prefix_caching: bool = False
    # blocks of the host pool that preempted sequences' K/V are copied to (kv_offload.py; pinned on
    # CUDA); 0 = none, preempted sequences are recomputed. The server sizes it (TANDEM_KV_OFFLOAD_GIB)
    kv_offload_blocks: int = 0


def build_core(
    model: torch.nn.Module,
    config: EngineConfig,
    eos_token_ids: frozenset[int] = frozenset(),
    step_observer: Callable[[StepTiming], None] | None = None,
) -> EngineCore:
    model.set_attn_implementation(register())
    if config.fuse_projections:
        log.info("fused %d groups of projections", fuse_projections(model))
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library(config.blas_library)
    shape = CacheShape.of(model.config)
    capacity = config.num_blocks * config.block_size
    model_len = config.max_model_len or getattr(
        model.config.get_text_config(), "max_position_embeddings", None
    )
    max_model_len = min(model_len or capacity, capacity)
    if max_model_len < 2:
        raise ValueError(f"the KV cache holds {capacity} tokens: too small to serve anything")
    log.info(
        "KV cache: %d blocks x %d tokens (%.2f GiB), context length %d",
        config.num_blocks,
        config.block_size,
        capacity * shape.bytes_per_token(dtype) / 2**30,
        max_model_len,
    )
    if config.kv_offload_blocks:
        log.info(
            "KV offload: a host pool of %d blocks (%.2f GiB) for preempted sequences",
            config.kv_offload_blocks,
            config.kv_offload_blocks * config.block_size * shape.bytes_per_token(dtype) / 2**30,
        )
    cache = KVCache(shape, config.num_blocks, config.block_size, dtype, device, config.kv_layout)
    scheduler = build_scheduler(config, model)
    runner = ModelRunner(
        model,
        cache,
        device,
        cuda_graphs=config.cuda_graphs,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        compile_decode=config.compile_decode,
        compile_backend=config.compile_backend,
        fold_rotary=config.fold_rotary,
        compile_prefill=config.compile_prefill,
        kv_offload_blocks=config.kv_offload_blocks,
    )
    runner.capture_graphs()  # at start-up, before the server reports SERVING
    async_loop = config.step_loop == "async" or (config.step_loop == "auto" and device.type == "cuda")
    core = EngineCore(
        runner, scheduler, max_model_len, eos_token_ids, async_loop, idle_window_s=config.idle_window_s
    )
    if config.compile_prefill:
        compile_prefill_shapes(core)
    core.step_observer = step_observer  # after the compile warm-up: its steps are not traffic
    return core


def build_scheduler(config: EngineConfig, model: torch.nn.Module) -> Scheduler:
    """The scheduler of `config` (its blocks, prefix caching, host pool) for `model`'s cache."""
    return Scheduler(
        BlockManager(config.num_blocks, config.block_size, config.prefix_caching, _cache_salt(model)),
        config.max_num_seqs,
        config.max_num_batched_tokens,
        HostBlocks(config.kv_offload_blocks) if config.kv_offload_blocks else None,
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
        core.add(GenerationRequest(f"compile-prefill-{i}", prompt, params))
    while core.scheduler.has_work:
        core.step()


def _cache_salt(model: torch.nn.Module) -> str:
    """What names the model in the prefix cache's digests: K/V of one model are not another's."""
    config = model.config
    return f"{getattr(config, '_name_or_path', '')}:{config.model_type}:{next(model.parameters()).dtype}"
