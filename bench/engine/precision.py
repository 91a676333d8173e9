"""The engine benchmarks' precisions: which linear layers and which KV cache run in FP8
(`--quantization`, `--kv-cache-dtype`, the server's settings of the same names), and what a step
must read at each.

`tandem bench gpu` takes comma lists and runs every combination beside the first, which is the
baseline its ratios are taken against (`--quantization none,fp8 --kv-cache-dtype auto,fp8`: bf16,
FP8 KV, FP8 weights, both, in one run); the other benchmarks take one value each.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.service.engine.ops.kv_quant import KV_CACHE_DTYPES, storage_dtype

QUANTIZATIONS = ("none", "fp8")  # none: EngineConfig.quantization None, the model as it is


@dataclass(frozen=True)
class Precision:
    quantization: str = "none"
    kv_cache_dtype: str = "auto"

    @property
    def suffix(self) -> str:
        """What a run's label gains beside its engine's name: "" at the defaults, "+fp8+kv-fp8" ..."""
        parts = [self.quantization] if self.quantization != "none" else []
        parts += [f"kv-{self.kv_cache_dtype}"] if self.kv_cache_dtype != "auto" else []
        return "".join(f"+{p}" for p in parts)

    def engine(self) -> dict:
        """The EngineConfig fields of this precision."""
        quantization = None if self.quantization == "none" else self.quantization
        return {"quantization": quantization, "kv_cache_dtype": self.kv_cache_dtype}

    def kv_bytes_per_token(self, config: object, model_dtype: torch.dtype) -> int:
        """K and V of one token in every layer (the scales, a few per layer, left out)."""
        from tandem.service.engine.ops.kv_cache import CacheShape

        return CacheShape.of(config).bytes_per_token(storage_dtype(self.kv_cache_dtype, model_dtype))


# the precisions the FP8 benchmarks name (tandem bench fp8, tandem bench accuracy)
NAMED = {
    "bf16": Precision(),
    "w8a8": Precision(quantization="fp8"),
    "kv8": Precision(kv_cache_dtype="fp8"),
    "w8a8+kv8": Precision(quantization="fp8", kv_cache_dtype="fp8"),
}


def choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of `allowed` names, in the order given, each once."""

    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(n for n in text.split(",") if n))
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {', '.join(allowed)}")
        return names

    return parse


def add_options(ap: argparse.ArgumentParser, lists: bool = False) -> None:
    """--quantization and --kv-cache-dtype: one value each, or (`lists`) comma lists of them."""
    kind = choices if lists else _one
    many = (" or a comma list: each combination with the other option's values a run of its own, "
            "the first the baseline of the ratios") if lists else ""
    ap.add_argument("--quantization", type=kind(QUANTIZATIONS), default=kind(QUANTIZATIONS)("none"),
                    help=f"linear layers: none (the model's dtype) or fp8 (W8A8){many}")
    ap.add_argument("--kv-cache-dtype", type=kind(KV_CACHE_DTYPES), default=kind(KV_CACHE_DTYPES)("auto"),
                    help=f"KV cache: auto (the model's dtype) or fp8{many}")


def _one(allowed: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(allowed)}")
        return text

    return parse


def precisions(a: argparse.Namespace) -> list[Precision]:
    """Every combination of --quantization and --kv-cache-dtype, the first given first."""
    quantizations = a.quantization if isinstance(a.quantization, list) else [a.quantization]
    kv_dtypes = a.kv_cache_dtype if isinstance(a.kv_cache_dtype, list) else [a.kv_cache_dtype]
    return [Precision(q, kv) for q, kv in itertools.product(quantizations, kv_dtypes)]


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's weights take on the device as its engine holds them (FP8 ones included, with
    their scales, whether the engine keeps them as parameters or buffers)."""
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
