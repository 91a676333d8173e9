"""What a step's torch.compile covers: the whole model, or one decoder layer that every layer reuses.

Compiling the whole model (scope "model") makes Dynamo trace its Python forward layer after layer,
in every new process: a warm compile cache saves Inductor's work, not that tracing, which grows
with the layers (docs/benchmarks.md). Scope "layer" is PyTorch's regional compilation: the steps
run a copy of the model whose decoder layers each call one compiled function with their layer.
Dynamo caches that function's code once for all of them (the layer's weights are inputs of the
graph, not constants: inline_inbuilt_nn_modules), so one trace and one Inductor graph serve every
layer. The embedding, the final norm and the LM head run eagerly around them, and a step enters
the compiled code once per layer, from Python (a CUDA graph replays the decode steps whole).

The attention ops take the layer's index (attention.py). Read from the layer, it would be a
constant of the graph, and each layer a recompile; the layers hand it to the compiled function
instead, as an argument that Dynamo keeps symbolic (`LAYER_SOURCE`), which reaches the attention
function with the step's other keyword arguments.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

COMPILE_SCOPES = ("model", "layer")
LAYER_ARG = "tandem_layer"  # the keyword the attention function reads the layer's index from
# where Dynamo finds that index in the compiled function's frame: an int it keeps symbolic (an exact
# source name: what every PyTorch with the setting matches; newer ones also read it as a regex)
LAYER_SOURCE = f"L['{LAYER_ARG}']"


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's decoder layers (transformers' `model.model.layers`), or None where it has none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


def scope_for(scope: str, model: nn.Module) -> str:
    """`scope` as `model` can be compiled: a model without decoder layers compiles whole."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {scope!r}: expected one of {', '.join(COMPILE_SCOPES)}")
    return scope if decoder_layers(model) is not None else "model"


def compile_forward(model: nn.Module, scope: str, backend: str, dynamic: bool | None = None) -> Callable:
    """`model`'s forward, compiled over `scope`: the model itself, or each of its decoder layers."""
    if scope == "model":
        return torch.compile(model, backend=backend, dynamic=dynamic)
    if scope != "layer":
        raise ValueError(f"compile scope {scope!r}: expected one of {', '.join(COMPILE_SCOPES)}")
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers (model.layers) to compile one by one")
    keep_layer_symbolic()
    compiled = torch.compile(_run_layer, backend=backend, dynamic=dynamic)
    inner = copy.copy(model.model)  # shallow: every module but the layer list is the model's own
    wrapped = nn.ModuleList(CompiledLayer(layer, i, compiled) for i, layer in enumerate(layers))
    inner._modules = {**inner._modules, "layers": wrapped}
    layered = copy.copy(model)
    layered._modules = {**model._modules, "model": inner}
    return layered


def keep_layer_symbolic() -> None:
    """Have Dynamo trace the layer's index as a symbolic int from the first compile (a process-wide
    setting, read when a frame is compiled; it names only the compiled layer function's argument)."""
    config = torch.compiler.config
    sources = [s for s in config.dynamic_sources.split(",") if s]
    if LAYER_SOURCE not in sources:
        config.dynamic_sources = ",".join([*sources, LAYER_SOURCE])


def _run_layer(layer: nn.Module, *args: object, tandem_layer: int, **kwargs: object) -> object:
    return layer(*args, tandem_layer=tandem_layer, **kwargs)


class CompiledLayer(nn.Module):
    """Stands in for a decoder layer in the layered model: the compiled function, given the layer
    and its index."""

    def __init__(self, layer: nn.Module, index: int, compiled: Callable) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        self.compiled = compiled

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.compiled(self.layer, *args, tandem_layer=self.index, **kwargs)
