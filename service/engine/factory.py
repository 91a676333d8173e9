"""Assemble an engine from a loaded model and the settings: cache sizing, limits, wiring."""

from __future__ import annotations

import logging

import torch

from ..models.loader import LoadedModel
from ..settings import ServerSettings
from .async_engine import AsyncEngine
from .attention import register
from .block_manager import BlockManager
from .engine_core import EngineCore
from .kv_cache import CacheShape, KVCache
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .validation import Limits

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _num_blocks(settings: ServerSettings, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> int:
    if settings.num_kv_blocks is not None:
        return settings.num_kv_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * settings.kv_cache_memory_fraction)
    else:
        budget = int(settings.kv_cache_cpu_gib * 2**30)
    return KVCache.blocks_for_budget(shape, settings.block_size, dtype, budget)


def build_engine(loaded: LoadedModel, settings: ServerSettings) -> AsyncEngine:
    model = loaded.model
    device = next(model.parameters()).device
    model.set_attn_implementation(register())
    shape = CacheShape.of(model.config)
    dtype = next(model.parameters()).dtype
    num_blocks = _num_blocks(settings, shape, dtype, device)
    capacity = num_blocks * settings.block_size
    text_config = model.config.get_text_config()
    model_len = settings.max_model_len or getattr(text_config, "max_position_embeddings", None) or capacity
    max_model_len = min(model_len, capacity)
    if max_model_len < 2:
        raise ValueError(f"the KV cache holds {capacity} tokens: too small to serve anything")
    log.info(
        "KV cache: %d blocks x %d tokens (%.2f GiB), context length %d",
        num_blocks,
        settings.block_size,
        capacity * shape.bytes_per_token(dtype) / 2**30,
        max_model_len,
    )
    cache = KVCache(shape, num_blocks, settings.block_size, dtype, device)
    scheduler = Scheduler(
        BlockManager(num_blocks, settings.block_size), settings.max_num_seqs, settings.max_num_batched_tokens
    )
    runner = ModelRunner(model, cache, device, settings.cuda_graphs, settings.max_num_seqs, max_model_len)
    runner.capture_graphs()  # before the server reports SERVING
    core = EngineCore(
        runner,
        scheduler,
        max_model_len,
        loaded.eos_token_ids,
        on_updates=lambda updates: None,
    )
    limits = Limits(
        vocab_size=text_config.vocab_size,
        max_model_len=max_model_len,
        default_max_tokens=settings.default_max_tokens,
        max_stop_strings=settings.max_stop_strings,
        max_stop_string_chars=settings.max_stop_string_chars,
    )
    return AsyncEngine(core, loaded.tokenizer, limits, settings.max_waiting_requests)
