"""Fuse the linear layers that read the same input into one GEMM each (Q/K/V, gate/up).

transformers' model code calls `q_proj(x)`, `k_proj(x)` and `v_proj(x)` one after the other; a
decode step then runs three small GEMMs where one would read the same weights at a better
share of the memory bandwidth, with two kernel launches fewer per layer (and the same for the
MLP's gate and up projections). The model code stays as it is: each projection is replaced by a
part that hands out its slice of one fused GEMM, computed by whichever part is called first.
"""

from __future__ import annotations

import torch
from torch import nn

from .fp8_linear import Fp8Linear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinear(nn.Module):
    """Linear layers of one input as one: the weights stacked, the output split per layer. The
    layers are plain (nn.Linear) or FP8 (Fp8Linear), all of one kind."""

    def __init__(self, linears: list[nn.Linear] | list[Fp8Linear]) -> None:
        super().__init__()
        self.linear = _stacked(linears)
        self.sizes = [lin.out_features for lin in linears]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] | None = None
        self._taken = 0

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:  # the first part called on this input runs the fused GEMM
            self._outputs = self.linear(x).split(self.sizes, dim=-1)
            self._input, self._taken = x, 0
        out = self._outputs[index]
        self._taken += 1
        if self._taken == len(self.sizes):  # every part has its slice: hold no tensor past the call
            self._input = self._outputs = None
        return out


class LinearPart(nn.Module):
    """Stands where one of the fused linear layers stood; `forward(x)` = that layer's output."""

    def __init__(self, fused: FusedLinear, index: int, in_features: int, out_features: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # owned by the parent module, not by each part
        self.index = index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)


def _stacked(linears: list[nn.Linear] | list[Fp8Linear]) -> nn.Linear | Fp8Linear:
    if type(linears[0]) is Fp8Linear:
        return Fp8Linear.concat(linears)
    first = linears[0]
    out_features = sum(lin.out_features for lin in linears)
    stacked = nn.Linear(first.in_features, out_features, bias=first.bias is not None, device="meta")
    stacked.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
    if first.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    return stacked


def _fusable(linears: list[object]) -> bool:
    first = linears[0]
    if type(first) not in (nn.Linear, Fp8Linear):  # already fused, or quantized another way
        return False
    return all(
        type(lin) is type(first)
        and lin.in_features == first.in_features
        and (lin.bias is None) == (first.bias is None)
        and lin.weight.dtype == first.weight.dtype
        and lin.weight.device == first.weight.device
        for lin in linears
    )


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every Q/K/V and gate/up group in `model`, in place; -> groups fused (0 when done before)."""
    fused = 0
    for module in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not _fusable(linears):
                continue
            group = FusedLinear(linears)
            module.add_module("_".join(n.removesuffix("_proj") for n in names) + "_fused", group)
            for i, (name, lin) in enumerate(zip(names, linears, strict=True)):
                setattr(module, name, LinearPart(group, i, lin.in_features, lin.out_features))
            fused += 1
    return fused
