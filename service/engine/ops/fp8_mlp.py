"""The gated MLP of an FP8 model: SiLU(gate) * up and its per-token quantization in one kernel.

transformers' gated MLPs compute `down_proj(act_fn(gate_proj(x)) * up_proj(x))`; with FP8 linear
layers the product is then quantized per row (fp8_linear.quantize_rows) for the down projection.
Inductor compiles that as three kernels a layer: the product's per-row maximum in two (a split
reduction over the row) and the quantization, which reads the gate and up outputs again to compute
the product again. Here one program takes one row whole: it reads gate and up once, takes the
maximum and writes the e4m3 row and its scale; one launch a layer instead of three.

The arithmetic is the model's (the activation and the product rounded to the model's dtype, as its
eager modules round them) and then quantize_rows' (e4m3.py), so that the CPU path, which is
quantize_rows itself, is the reference the CUDA kernel is tested against.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from .e4m3 import FP8
from .fp8_linear import Fp8Linear, quantize_rows
from .fused_projections import FusedLinear, LinearPart

# the one forward the fused module reproduces (whitespace aside): the gated MLPs of the Llama,
# Mistral, Qwen2/3, Granite, OLMo 2 and SmolLM3 families
GATED_BODIES = (
    "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj",
    "returnself.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))",
)
# one program holds a row's gate and up whole (32 values a thread in 32 warps at the most); a
# wider MLP takes the torch path
MAX_KERNEL_WIDTH = 32768


@torch.library.custom_op("tandem::silu_mul_quant", mutates_args=())
def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (gate then up, the fused projection's output) -> (e4m3 [M, I], float32
    scales [M, 1]) = quantize_rows(silu(gate) * up)."""
    width = gate_up.shape[-1] // 2
    if gate_up.is_cuda and width <= MAX_KERNEL_WIDTH:
        from .triton_silu_mul_quant import silu_mul_quant_rows

        return silu_mul_quant_rows(gate_up)
    gate, up = gate_up.split(width, dim=-1)
    return quantize_rows(F.silu(gate) * up)


@silu_mul_quant.register_fake
def _(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    return gate_up.new_empty(rows, width, dtype=FP8), gate_up.new_empty(rows, 1, dtype=torch.float32)


class Fp8GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with FP8 layers: the gate and up projections one GEMM, the
    activation, product and quantization one op, then the down projection's GEMM."""

    def __init__(self, gate_up: Fp8Linear, down: Fp8Linear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = self.down.of_quantized(*silu_mul_quant(self.gate_up(rows)), x.dtype)
        return y.reshape(*x.shape[:-1], self.down.out_features)


def _is_gated_silu_mlp(module: nn.Module) -> bool:
    """A module whose forward is exactly the gated MLP's, with SiLU as its activation."""
    if not isinstance(getattr(module, "act_fn", None), nn.SiLU | SiLUActivation):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    body = "".join(source.split("\n", 1)[-1].split())
    return body in GATED_BODIES


def _fused_fp8_gate_up(module: nn.Module) -> Fp8Linear | None:
    """The FP8 GEMM behind `module`'s gate and up projections, where they are the two parts (gate
    first) of one fused FP8 layer."""
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not (isinstance(gate, LinearPart) and isinstance(up, LinearPart) and gate.fused is up.fused):
        return None
    fused: FusedLinear = gate.fused
    if (gate.index, up.index) != (0, 1) or len(fused.sizes) != 2 or fused.sizes[0] != fused.sizes[1]:
        return None
    return fused.linear if isinstance(fused.linear, Fp8Linear) else None


@torch.no_grad()
def fuse_fp8_mlps(model: nn.Module) -> int:
    """Every gated SiLU MLP of `model` whose gate/up projection is one fused FP8 layer and whose
    down projection is FP8, replaced in place by Fp8GatedMLP -> MLPs replaced."""
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            gate_up = _fused_fp8_gate_up(child)
            down = getattr(child, "down_proj", None)
            if gate_up is not None and isinstance(down, Fp8Linear) and _is_gated_silu_mlp(child):
                setattr(parent, name, Fp8GatedMLP(gate_up, down))
                done += 1
    return done
