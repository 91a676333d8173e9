"""Assemble an engine from a loaded model and the settings: cache sizing, limits, wiring."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..api_processes import api_processes
from ..contract import Limits, StepTiming
from ..cpus import usable_cores
from ..models.loader import LoadedModel
from ..settings import ServerSettings
from .config import EngineConfig
from .core_builder import build_core
from .engine_core import EngineCore
from .grammar import Grammars
from .ops.fp8_linear import compute_dtype
from .ops.kv_cache import CacheShape, KVCache
from .ops.kv_quant import storage_dtype

log = logging.getLogger(__name__)
DEFAULT_OFFLOAD_GIB = 4.0  # the host pool on CUDA when TANDEM_KV_OFFLOAD_GIB is unset (vLLM's swap space)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def configure_threads(settings: ServerSettings, device: torch.device) -> int:
    """Set the engine process's intra-op threads; on CPU the fronts keep a core each, since threads
    that wait on a descheduled sibling make every step slower (docs/benchmarks.md)."""
    threads = settings.cpu_threads
    if threads is None and device.type == "cpu":
        threads = max(1, usable_cores() - api_processes(settings))
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _num_blocks(settings: ServerSettings, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> int:
    """`dtype`: the cache's storage dtype (e4m3 holds twice the blocks of bf16 in one budget)."""
    if settings.num_kv_blocks is not None:
        return settings.num_kv_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * settings.kv_cache_memory_fraction)
    else:
        budget = int(settings.kv_cache_cpu_gib * 2**30)
    return KVCache.blocks_for_budget(shape, settings.block_size, dtype, budget)


def _offload_blocks(
    settings: ServerSettings, shape: CacheShape, dtype: torch.dtype, device: torch.device
) -> int:
    gib = settings.kv_offload_gib
    if gib is None:
        gib = DEFAULT_OFFLOAD_GIB if device.type == "cuda" else 0.0
    return KVCache.blocks_for_budget(shape, settings.block_size, dtype, int(gib * 2**30))


def build_engine(
    loaded: LoadedModel,
    settings: ServerSettings,
    step_observer: Callable[[StepTiming], None] | None = None,
) -> tuple[EngineCore, Limits]:
    """The server's engine core for `loaded`, and the request limits it sets."""
    model = loaded.model
    device = next(model.parameters()).device
    kv_dtype = storage_dtype(settings.kv_cache_dtype, compute_dtype(model))
    shape = CacheShape.of(model.config)
    # the server runs these on CUDA only (config.py says why); tests and benchmarks may ask for
    # them on the CPU, and build_core settles what the device and the model allow
    cuda = device.type == "cuda"
    quantization = settings.quantization
    if loaded.quantization is not None and quantization is not None:
        # the checkpoint's FP8 layers are what --quantization would make; the layers it keeps in
        # the model's dtype (its `ignore` list) stay there, as the publisher chose
        log.info(
            "the checkpoint is %s already: quantization %s changes nothing", loaded.quantization, quantization
        )
        quantization = None
    config = EngineConfig(
        num_blocks=_num_blocks(settings, shape, kv_dtype, device),
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        prefix_caching=settings.prefix_caching,
        kv_offload_blocks=_offload_blocks(settings, shape, kv_dtype, device),
        max_model_len=settings.max_model_len,
        cuda_graphs=settings.cuda_graphs,
        step_loop=settings.step_loop,
        compile_decode=settings.compile and cuda,
        compile_prefill=settings.compile and settings.compile_prefill and cuda,
        compile_scope=settings.compile_scope,
        fuse_projections=settings.fuse_projections and cuda,
        fold_rotary=settings.fold_rotary and cuda,
        kv_cache_layout=settings.kv_cache_layout,
        quantization=quantization,
        kv_cache_dtype=settings.kv_cache_dtype,
        blas_library=settings.blas_library,
        telemetry_window_s=settings.telemetry_window_s,
    )
    # the KV offload pool pinned beside the compile and the warm-up: seconds off the start
    core = build_core(model, config, loaded.eos_token_ids, step_observer, host_pool_in_background=True)
    start = time.perf_counter()
    core.grammars = Grammars(
        loaded.tokenizer, model.config.get_text_config().vocab_size, loaded.eos_token_ids,
        settings.grammar_cache_size, pin_memory=cuda, threads=4 if cuda else 1,
    )
    log.info("the grammar engine's view of the vocabulary built in %.2f s", time.perf_counter() - start)
    limits = Limits(
        vocab_size=model.config.get_text_config().vocab_size,
        max_model_len=core.max_model_len,
        default_max_tokens=settings.default_max_tokens,
        max_stop_strings=settings.max_stop_strings,
        max_stop_string_chars=settings.max_stop_string_chars,
    )
    return core, limits
