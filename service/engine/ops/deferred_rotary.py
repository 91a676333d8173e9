"""The rotary embedding applied by the attention ops as they load Q and K, not by the model code.

In a compiled step each layer rotates its query and new key in element-wise kernels of its own:
two small ones per layer in a decode step (launch latency for a few microseconds of work), and in
a step with prompts one that computes cos and sin again for every head of every token, far from
the memory bandwidth (docs/benchmarks.md). The attention ops load that query and key anyway, so
they rotate them there, from each token's position and the model's own inverse frequencies: the
decode kernel as it attends, the mixed op as it writes the step's K/V into the cache.

The model code stays transformers': the engine runs a *deferred model*, a shallow copy that shares
every module of the model but its rotary embedding, which hands out empty cos/sin. The model
family's `apply_rotary_pos_emb` (wrapped once per family) passes Q and K through unrotated when it
is given those; with real cos/sin it does what it always did, so `generate()` and any other model
of the family are untouched.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

# RoPE types whose inverse frequencies are fixed once the model is built ("dynamic" and friends
# recompute them from the sequence length, which the op does not know)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True)
class DeferredRotary:
    """What the attention ops need to rotate Q and K as transformers would."""

    inv_freq: torch.Tensor  # [head_dim // 2] float32
    scaling: float  # the RoPE type's attention scaling of cos and sin (1.0 for most)


class _DeferredRotaryEmbedding(nn.Module):
    """Stands in for the model's rotary embedding in the deferred model: empty cos/sin."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        empty = x.new_empty(*position_ids.shape, 0)
        return empty, empty


def _passes_deferred(apply: Callable) -> Callable:
    @functools.wraps(apply)
    def apply_unless_deferred(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cos.shape[-1] == 0:  # the deferred model: the attention ops rotate Q and K
            return q, k
        return apply(q, k, cos, sin, *args, **kwargs)

    apply_unless_deferred.tandem_passes_deferred = True
    return apply_unless_deferred


def model_family(model: nn.Module) -> ModuleType | None:
    """The transformers module of the model's attention layers (where its family's
    `apply_rotary_pos_emb` lives), or None for a model without such layers."""
    attention = next((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")), None)
    return None if attention is None else sys.modules[type(attention).__module__]


def defer_rotary(model: nn.Module, head_dim: int) -> tuple[nn.Module, DeferredRotary | None]:
    """-> (deferred model, what the attention ops need), or (the model itself, None) where the model's
    rotary embedding is not one the op reproduces (its RoPE type, partial rotary, no family hook)."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    family = model_family(model)
    inv_freq = getattr(rotary, "inv_freq", None)
    if (
        family is None
        or getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES
        or not isinstance(inv_freq, torch.Tensor)
        or 2 * inv_freq.numel() != head_dim
    ):
        return model, None
    apply = getattr(family, "apply_rotary_pos_emb", None)
    if apply is None:
        return model, None
    if not getattr(apply, "tandem_passes_deferred", False):
        family.apply_rotary_pos_emb = _passes_deferred(apply)
    deferred_inner = copy.copy(inner)
    deferred_inner._modules = {**inner._modules, "rotary_emb": _DeferredRotaryEmbedding()}
    deferred = copy.copy(model)
    deferred._modules = {**model._modules, "model": deferred_inner}
    return deferred, DeferredRotary(inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0)))


def rotate(positions: torch.Tensor, rotary: DeferredRotary, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each x [B, H, D] (one dtype) rotated at its row's position [B], with transformers'
    arithmetic: fp32 angles, cos/sin in x's dtype (computed once for all of them), then
    x * cos + rotate_half(x) * sin in x's dtype."""
    angles = positions.float()[:, None] * rotary.inv_freq.to(positions.device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [B, 1, D]
    cos = (angles.cos() * rotary.scaling).to(xs[0].dtype)
    sin = (angles.sin() * rotary.scaling).to(xs[0].dtype)
    half = xs[0].shape[-1] // 2
    return tuple(x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin for x in xs)
