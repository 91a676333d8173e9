"""One step's forward and sampling: the model over the step's packed tokens, as transformers takes
them, its attention ops reading the step's metadata; then each sampling row's token, written into
the slot's buffer. The eager step (model_runner.py) and the captured decode graphs
(cuda_graphs.py) run this same call."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .batch import DeviceBatch
from .ops.attention_metadata import AttentionMetadata
from .ops.mixed_op import attending
from .sampler import SampleOutput, sample


def forward_and_sample(
    forward: Callable[..., object],
    input_ids: torch.Tensor,  # [T], carried tokens already in place
    dev: DeviceBatch,
    meta: AttentionMetadata,
    keep: torch.Tensor | int,  # the rows whose logits are kept (0 = every row)
    tokens: torch.Tensor,  # [S] the slot's sampled-token buffer
) -> tuple[torch.Tensor, SampleOutput[torch.Tensor]]:
    """-> (the sampled rows' logits, the sample); the tokens are also copied into `tokens`."""
    with attending(meta):
        out = forward(
            input_ids=input_ids[None],
            position_ids=dev.positions[None],
            logits_to_keep=keep,
            use_cache=False,
            tandem_meta=meta,
        )
    logits = out.logits[0, : len(tokens)]
    sampled = sample(logits, dev.sampling)
    tokens.copy_(sampled.tokens)
    return logits, sampled
