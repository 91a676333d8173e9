"""Load a causal LM and its tokenizer: a transformers directory, a GGUF file, or the default.

A directory holding an FP8 checkpoint (compressed-tensors or block-wise FP8) loads with its linear
layers in FP8 (fp8_checkpoint.py); any other quantization_config is refused with what loads.

GGUF files are de-quantized by transformers on load, which is slow; the result is saved once
as safetensors under the cache directory, so the next start loads in well under a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..cache_dirs import default_cache_dir
from .default_model import default_gguf_path, served_name
from .fp8_checkpoint import checkpoint_format, load_fp8_linears, scales_left_unread
from .paths import converted_path

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # served model name
    source: str  # where it came from, for model info
    eos_token_ids: frozenset[int]
    path: Path  # the transformers directory loaded (for a GGUF file: its converted copy)
    quantization: str | None = None  # the checkpoint's own: "fp8" when its linear layers loaded in FP8


STALE_STAGING_S = 6 * 3600  # a conversion staging folder this old was abandoned (its server stopped)


def remove_stale_staging(cache_dir: Path, max_age_s: float = STALE_STAGING_S) -> list[Path]:
    """Delete conversion staging folders left by servers stopped mid-conversion; -> those deleted.
    Young ones are kept: another server sharing the cache may be converting right now."""
    removed = []
    now = time.time()
    for staging in cache_dir.glob(".convert-*"):
        try:
            if now - staging.stat().st_mtime > max_age_s:
                shutil.rmtree(staging, ignore_errors=True)
                removed.append(staging)
        except OSError:  # gone meanwhile
            continue
    return removed


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """De-quantize a GGUF file into a safetensors directory, once; return that directory."""
    target = converted_path(gguf, cache_dir)
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors under %s (first start only)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantized weights are plain tensors now; forget the GGUF quantizer so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    cache_dir.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_staging(cache_dir):
        log.info("removed %s, left by a conversion that never finished", stale)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a crash never leaves a half-written model behind
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids that end generation, as `generate()` would use them (generation config first)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def load_model(
    source: str | None,
    name: str | None,
    device: torch.device,
    dtype: str = "auto",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """`source`: None (the embedded default), a transformers directory, or a .gguf file."""
    cache_dir = cache_dir or default_cache_dir()
    if source is None:
        path = convert_gguf(default_gguf_path(), cache_dir)
        origin = f"embedded default ({default_gguf_path().name})"
    else:
        given = Path(source).expanduser()
        if given.is_file() and given.suffix == ".gguf":
            path = convert_gguf(given, cache_dir)
        elif (given / "config.json").is_file():
            path = given
        else:
            raise FileNotFoundError(f"{source}: not a transformers model directory or a .gguf file")
        origin = str(given)
    served = served_name(source, name)
    model, quantization = _load_weights(path, resolve_dtype(dtype, device))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = model.to(device).eval()
    return LoadedModel(model, tokenizer, served, origin, _eos_ids(model, tokenizer), path, quantization)


def _load_weights(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, str | None]:
    """The model in `path` (on the CPU) and its quantization: "fp8" for an FP8 checkpoint."""
    fmt = checkpoint_format(path)
    if fmt is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), None
    # Without its quantization_config, transformers builds the plain model: the e4m3 weights land in
    # `dtype` (exactly) and are replaced below; the scales are left for load_fp8_linears to read.
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    with scales_left_unread():
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    layers = load_fp8_linears(model, path, fmt)
    log.info("loaded %d linear layers in FP8 from a %s checkpoint", layers, fmt.description)
    return model, "fp8"
