"""FP8 checkpoints as model publishers ship them for Hopper, read into the engine's FP8 layers.

Two formats load:
- compressed-tensors "float-quantized" (the "FP8-dynamic" checkpoints of RedHatAI / neuralmagic,
  written by llm-compressor): e4m3 weights with a scale per output channel (or one per tensor),
  activations quantized per token at run time: exactly what `Fp8Linear` computes.
- block-wise FP8 (`quant_method: fp8`, as Qwen3-FP8 and DeepSeek publish): e4m3 weights with a
  scale per 128 x 128 block (`weight_scale_inv`, a multiplier despite its name), or one per tensor.
  `Fp8Linear` scales whole output channels, so each block is dequantized with its scale and the
  row quantized again: one more e4m3 rounding of every weight (docs/quantization.md measures it).

The model is built by transformers from the checkpoint with its quantization_config set aside
(the e4m3 weights land in the model's dtype, where every e4m3 value is exact), and the quantized
linear layers are then replaced by `Fp8Linear`s made from the checkpoint's own tensors. That keeps
transformers' quantizers (which differ by version and by device, and would wrap the layers in
modules of their own) out of the path, and reads nothing but the published file layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from ..engine.ops.e4m3 import FP8
from ..engine.ops.fp8_linear import Fp8Linear, compute_dtype, fits_fp8_gemm, quantize_rows

log = logging.getLogger(__name__)

SUPPORTED = (
    "compressed-tensors float-quantized FP8 (8-bit float weights, channel or tensor strategy, "
    "symmetric, static; input activations 8-bit float, token strategy, dynamic) and block-wise FP8 "
    "(quant_method fp8, e4m3, dynamic activations, weight_block_size [m, n] or null)"
)


# block-wise FP8 names its scales weight_scale_inv; per-tensor checkpoints of it use either name
BLOCK_SCALES = ("weight_scale_inv", "weight_scale")


class UnsupportedQuantization(ValueError):
    """A checkpoint quantized in a way the engine does not run; the message names what does."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}; Tandem loads {SUPPORTED}")


class CheckpointTensors:
    """The tensors of a directory's safetensors files (one or sharded), read one at a time."""

    def __init__(self, path: Path) -> None:
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        for file in sorted(path.glob("*.safetensors")):
            handle = self._stack.enter_context(safe_open(file, framework="pt"))
            self._files.update((key, handle) for key in handle.keys())
        if not self._files:
            raise FileNotFoundError(f"{path}: no safetensors files (FP8 checkpoints are read from them)")

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def keys(self) -> list[str]:
        return list(self._files)

    def get(self, key: str) -> torch.Tensor:
        return self._files[key].get_tensor(key)


class Fp8Format(Protocol):
    """How one checkpoint format names and scales its FP8 weights."""

    description: str  # what was loaded, for the log and LoadedModel.quantization

    def linears(self, model: nn.Module, tensors: CheckpointTensors) -> list[str]:
        """Names of the model's linear layers the checkpoint holds in FP8."""
        ...

    def weight(self, name: str, tensors: CheckpointTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `name`'s (e4m3 weights [out, in], float32 scales [out]) as Fp8Linear takes them."""
        ...


def _e4m3(name: str, tensors: CheckpointTensors) -> torch.Tensor:
    key = f"{name}.weight"
    if key not in tensors:
        raise ValueError(f"the checkpoint has no {key}, though its quantization_config quantizes {name}")
    weight = tensors.get(key)
    if weight.dtype != FP8 or weight.dim() != 2:
        raise UnsupportedQuantization(f"{key} is {weight.dtype} {tuple(weight.shape)}, not 2-D {FP8}")
    return weight


def _per_channel(scale: torch.Tensor, rows: int, key: str) -> torch.Tensor:
    """A per-channel ([out] or [out, 1]) or per-tensor (one value) scale as float32 [out]."""
    scale = scale.float().flatten()
    if scale.numel() == 1:
        return scale.expand(rows).clone()  # one scale for the tensor is the same scale for each row
    if scale.numel() != rows:
        raise ValueError(f"{key}: {scale.numel()} scales for {rows} output channels")
    return scale


@dataclass(frozen=True)
class CompressedTensorsFp8:
    """compressed-tensors' float-quantized FP8: the config groups say which layers, `ignore` which not."""

    config: Any  # compressed_tensors.quantization.QuantizationConfig
    description: str

    def linears(self, model: nn.Module, tensors: CheckpointTensors) -> list[str]:
        from compressed_tensors.utils import match_named_modules

        targets = [t for scheme in self.config.config_groups.values() for t in scheme.targets]
        matched = match_named_modules(model, targets, self.config.ignore or [])
        return [name for name, module in matched if isinstance(module, nn.Linear)]

    def weight(self, name: str, tensors: CheckpointTensors) -> tuple[torch.Tensor, torch.Tensor]:
        weight = _e4m3(name, tensors)
        key = f"{name}.weight_scale"
        if key not in tensors:
            raise ValueError(f"the checkpoint has FP8 weights for {name} but no {key}")
        return weight, _per_channel(tensors.get(key), weight.shape[0], key)


@dataclass(frozen=True)
class BlockFp8:
    """quant_method fp8: every layer whose weight the checkpoint stores in e4m3 with a scale."""

    block: tuple[int, int] | None  # (rows, columns) of a scale's block; None: one scale per tensor
    description: str

    def linears(self, model: nn.Module, tensors: CheckpointTensors) -> list[str]:
        return [
            name
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and self._scale_key(name, tensors) is not None
        ]

    def _scale_key(self, name: str, tensors: CheckpointTensors) -> str | None:
        return next((f"{name}.{s}" for s in BLOCK_SCALES if f"{name}.{s}" in tensors), None)

    def weight(self, name: str, tensors: CheckpointTensors) -> tuple[torch.Tensor, torch.Tensor]:
        weight = _e4m3(name, tensors)
        key = self._scale_key(name, tensors)
        assert key is not None  # linears() chose the layers that have one
        scale = tensors.get(key).float()
        rows, columns = weight.shape
        if self.block is None or scale.numel() == 1:
            return weight, _per_channel(scale, rows, key)
        block_rows, block_columns = self.block
        blocks = (-(-rows // block_rows), -(-columns // block_columns))
        if tuple(scale.shape) != blocks:
            raise ValueError(f"{key}: scales {tuple(scale.shape)} for {blocks} blocks of {self.block}")
        full = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)[:, :columns]
        # Fp8Linear scales whole rows: the row's weights, each exact in float32, rounded to e4m3 again
        requantized, row_scale = quantize_rows(weight.float() * full)
        return requantized, row_scale.flatten()


def _compressed_tensors(config: dict[str, Any]) -> CompressedTensorsFp8:
    from compressed_tensors.quantization import QuantizationConfig

    sparsity = config.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise UnsupportedQuantization(f"compressed-tensors sparsity {sparsity.get('format')!r} (e.g. 2:4)")
    if config.get("transform_config"):
        raise UnsupportedQuantization("compressed-tensors transforms (rotations such as SpinQuant/QuIP)")
    parsed = QuantizationConfig.model_validate(config)
    if parsed.kv_cache_scheme is not None:
        # the KV cache's dtype is --kv-cache-dtype's to choose; its scales here would be unused
        log.info("the checkpoint's kv_cache_scheme is not used: the KV cache follows --kv-cache-dtype")
    strategies = set()
    for group, scheme in parsed.config_groups.items():
        fmt = scheme.format or parsed.format
        if fmt != "float-quantized":
            raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} (config group {group})")
        weights, inputs = scheme.weights, scheme.input_activations
        if weights is None or not _is_fp8(weights) or weights.dynamic:
            raise UnsupportedQuantization(f"config group {group}'s weights: {_args(weights)}")
        if weights.strategy not in ("channel", "tensor"):
            raise UnsupportedQuantization(f"config group {group}'s weights: strategy {weights.strategy}")
        if inputs is None:
            raise UnsupportedQuantization(f"config group {group}: weight-only FP8 (W8A16)")
        if not _is_fp8(inputs) or inputs.strategy != "token" or inputs.dynamic is not True:
            raise UnsupportedQuantization(f"config group {group}'s input activations: {_args(inputs)}")
        if scheme.output_activations is not None:
            raise UnsupportedQuantization(f"config group {group}: quantized output activations")
        strategies.add(str(weights.strategy))
    if not parsed.config_groups:
        raise UnsupportedQuantization("compressed-tensors config without config groups")
    weights = "/".join(sorted(strategies))
    return CompressedTensorsFp8(
        parsed, f"compressed-tensors FP8 ({weights} weights, dynamic per-token activations)"
    )


def _is_fp8(args: Any) -> bool:
    return args.num_bits == 8 and args.type == "float" and args.symmetric


def _args(args: Any) -> str:
    if args is None:
        return "none"
    dynamic = "dynamic" if args.dynamic is True else "static" if args.dynamic is False else str(args.dynamic)
    symmetric = "symmetric" if args.symmetric else "asymmetric"
    return f"{args.num_bits}-bit {args.type}, {args.strategy} strategy, {symmetric}, {dynamic}"


def _block_fp8(config: dict[str, Any]) -> BlockFp8:
    from transformers import FineGrainedFP8Config

    if config.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantization(f"FP8 format {config['fmt']!r}")
    parsed = FineGrainedFP8Config(**{k: v for k, v in config.items() if k != "fmt"})
    if parsed.activation_scheme != "dynamic":
        scheme = parsed.activation_scheme
        raise UnsupportedQuantization(f"FP8 activation_scheme {scheme!r} (static input scales)")
    if parsed.weight_block_size is None:
        return BlockFp8(None, "FP8 (per-tensor weights, dynamic per-token activations)")
    rows, columns = parsed.weight_block_size
    return BlockFp8((rows, columns), f"block-wise FP8 ({rows}x{columns} blocks, requantized per channel)")


def checkpoint_format(path: Path) -> Fp8Format | None:
    """The FP8 format of the checkpoint in `path` (its config.json's quantization_config); None for
    one without quantization. UnsupportedQuantization for any other quantization."""
    config = json.loads((path / "config.json").read_text()).get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _block_fp8(config)
    raise UnsupportedQuantization(f"{path}: quant_method {method!r}")


class _ScalesReport(logging.Filter):
    """Drops transformers' load report when all it reports is the FP8 scales it left unread (they are
    read by load_fp8_linears); a report of anything else goes through whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        rows = [[cell.strip() for cell in line.split("|")] for line in message.splitlines() if "|" in line]
        rows = [row for row in rows if len(row) > 1 and row[0] != "Key"]
        scales_only = all(status == "UNEXPECTED" and key.endswith(BLOCK_SCALES) for key, status, *_ in rows)
        return not (rows and scales_only)


@contextlib.contextmanager
def scales_left_unread() -> Iterator[None]:
    """While transformers loads an FP8 checkpoint without its quantization: its report of the scale
    tensors no layer of the plain model takes is not shown (it would read as a broken checkpoint)."""
    logger = logging.getLogger("transformers.modeling_utils")
    quiet = _ScalesReport()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@torch.no_grad()
def load_fp8_linears(model: nn.Module, path: Path, fmt: Fp8Format) -> int:
    """Replace the layers `fmt` says the checkpoint in `path` holds in FP8 by Fp8Linears of its
    tensors, in place -> layers replaced. `model` was loaded from `path` without its quantization."""
    dtype = compute_dtype(model)
    done = 0
    with CheckpointTensors(path) as tensors:
        names = fmt.linears(model, tensors)
        for name in names:
            linear = model.get_submodule(name)
            weight, scale = fmt.weight(name, tensors)
            if weight.shape != linear.weight.shape:
                shapes = f"FP8 weights {tuple(weight.shape)}, layer {tuple(linear.weight.shape)}"
                raise ValueError(f"{name}: {shapes}")
            layer = Fp8Linear(weight, scale, linear.bias)
            if fits_fp8_gemm(linear):
                _replace(model, name, layer)
                done += 1
            else:  # no FP8 GEMM of this shape: the layer computes in the model's dtype
                linear.weight.copy_(layer.dequantized(dtype))
        _check_all_read(tensors, set(names))
    return done


def _check_all_read(tensors: CheckpointTensors, read: set[str]) -> None:
    """Scales the model had no linear layer for would leave raw e4m3 values in it as weights."""
    unread = sorted(
        key for key in tensors.keys() if key.endswith(BLOCK_SCALES) and key.rsplit(".", 1)[0] not in read
    )
    if unread:
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        raise UnsupportedQuantization(
            f"FP8 weights of modules that are not linear layers of this model, or that its "
            f"quantization_config does not name ({shown})"
        )
