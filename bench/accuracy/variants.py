"""The variants the accuracy benchmark compares, and each one's engine core.

A variant is the model in a dtype plus the engine's FP8 settings, passed through `EngineConfig`
exactly as the server passes them (`quantization`, `kv_cache_dtype`), so the benchmark measures
what a served model computes. A build that lacks a feature is reported, never measured: an FP8 KV
variant whose cache does not store 1-byte values, or a W8A8 variant with no FP8 layer, raises
`Unavailable` instead of yielding a bf16 number under an FP8 name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.bench.engine.precision import NAMED
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.ops.fp8_linear import quantization_of


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: torch.dtype  # the model's (its activations', and the cache's unless kv_cache_dtype says)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"


BASELINE = "bf16"
VARIANTS = {v.name: v for v in (
    Variant("fp32", torch.float32),  # a reference: how far bf16 itself is from float32
    *(Variant(name, torch.bfloat16, **precision.engine()) for name, precision in NAMED.items()),
)}


class Unavailable(Exception):
    """This build (or device) cannot run the variant; the message says why."""


def build(variant: Variant, load: Callable[[torch.dtype], torch.nn.Module], spec: EngineConfig) -> EngineCore:
    """A fresh model in the variant's dtype (FP8 quantization changes a model in place) and its core."""
    model = load(variant.dtype)
    config = dataclasses.replace(spec, quantization=variant.quantization,
                                 kv_cache_dtype=variant.kv_cache_dtype)
    try:
        core = build_core(model, config)
    except (ValueError, NotImplementedError, RuntimeError) as exc:  # a refusal, in the engine's words
        raise Unavailable(f"the engine refused it: {exc}") from exc
    check(variant, core)
    return core


def check(variant: Variant, core: EngineCore) -> None:
    """Raise Unavailable unless the core runs what the variant names."""
    if variant.quantization == "fp8" and quantization_of(core.runner.model) != "fp8":
        raise Unavailable("W8A8 not available in this build (no FP8 linear layer)")
    cache = core.runner.cache
    if variant.kv_cache_dtype == "fp8" and not cache.quantized:
        raise Unavailable(f"fp8 KV not available in this build (the cache stores {cache.k_store.dtype})")
