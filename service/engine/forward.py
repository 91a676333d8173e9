"""One step's forward and sampling: the model over the step's packed tokens, as transformers takes
them, its attention ops reading the step's metadata; then each sampling row's token, written into
the slot's buffer, and the logprobs of the prompt rows of sequences that ask for them. The eager
step (model_runner.py) and the captured decode graphs (cuda_graphs.py) run this same call; a step
with constrained rows runs the forward alone (`forward_logits`) and samples once its token masks
are filled (ModelRunner.sample_masked)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .batch import DeviceBatch, PromptRows
from .ops.attention_metadata import AttentionMetadata
from .ops.mixed_op import attending
from .sampler import PromptLogprobs, SampleOutput, prompt_logprobs, sample


def forward_logits(
    forward: Callable[..., object],
    input_ids: torch.Tensor,  # [T], carried tokens already in place
    dev: DeviceBatch,
    meta: AttentionMetadata,
    keep: torch.Tensor | int,  # the rows whose logits are kept (0 = every row)
    num_sampled: int,
    prompt: PromptRows | None = None,  # prompt rows whose logits `keep` holds after the sampled ones
) -> tuple[torch.Tensor, PromptLogprobs[torch.Tensor] | None]:
    """-> (the sampled rows' logits, the prompt rows' logprobs where `prompt` is given)."""
    with attending(meta):
        out = forward(
            input_ids=input_ids[None],
            position_ids=dev.positions[None],
            logits_to_keep=keep,
            use_cache=False,
            tandem_meta=meta,
        )
    s = num_sampled
    logits = out.logits[0, :s]
    if prompt is None:
        return logits, None
    targets = prompt.targets.to(logits.device, non_blocking=True)
    return logits, prompt_logprobs(out.logits[0, s : s + len(targets)], prompt, targets)


def forward_and_sample(
    forward: Callable[..., object],
    input_ids: torch.Tensor,  # [T], carried tokens already in place
    dev: DeviceBatch,
    meta: AttentionMetadata,
    keep: torch.Tensor | int,  # the rows whose logits are kept (0 = every row)
    tokens: torch.Tensor,  # [S] the slot's sampled-token buffer
    prompt: PromptRows | None = None,  # prompt rows whose logits `keep` holds after the sampled ones
) -> tuple[torch.Tensor, SampleOutput[torch.Tensor]]:
    """-> (the sampled rows' logits, the sample, with the prompt rows' logprobs where `prompt` is
    given); the tokens are also copied into `tokens`."""
    logits, prompt_part = forward_logits(forward, input_ids, dev, meta, keep, len(tokens), prompt)
    sampled = sample(logits, dev.sampling)
    tokens.copy_(sampled.tokens)
    sampled.prompt = prompt_part
    return logits, sampled
