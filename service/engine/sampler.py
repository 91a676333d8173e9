"""Sampling on the device: greedy, temperature, top-k, top-p, per-request seeds, logprobs; and the
logprobs of prompt tokens, for the requests that ask. Structured output's token masks are applied
to the logits before any of it (`mask_logits`): greedy, sampling and the logprobs all see the masked
distribution, as vLLM's do.

Randomness is a counter-based hash of (request seed, output index, vocabulary id), turned into
Gumbel noise: argmax(logits / T + Gumbel) samples from softmax(logits / T). A seeded request
therefore draws the same numbers whatever else is in the batch, and no generator state is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from .batch import PromptRows, SamplingTensors

_M64 = (1 << 64) - 1
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijective avalanche of 64-bit integers (wrapping arithmetic)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] uniforms in (0, 1), a pure function of (seed, step, vocab id)."""
    row = _mix64(_mix64(seeds * _GOLDEN + 1) + steps)  # [S]
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * _GOLDEN
    bits = _shr(_mix64(row[:, None] + cols), 40)  # top 24 bits
    # the top value, (2^24 - 0.5) / 2^24, rounds to 1.0 in float32, whose Gumbel noise is +inf: it
    # would win the argmax whatever its logit (a -inf one, masked or filtered, included)
    return ((bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    drop = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before > top_p[:, None]  # keeps at least the first token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


Rows = TypeVar("Rows", torch.Tensor, list)
Rows2 = TypeVar("Rows2", torch.Tensor, list)


@dataclass
class SampleOutput(Generic[Rows]):
    """A step's sampled rows: tensors where they are sampled and copied to the host, then lists
    (`tolist`) for the engine core, one record in both forms."""

    tokens: Rows  # [S] token ids
    logprobs: Rows | None = None  # [S] log-probability of the chosen token
    top_ids: Rows | None = None  # [S, K]
    top_logprobs: Rows | None = None  # [S, K]
    prompt: PromptLogprobs[Rows] | None = None  # the step's prompt rows (batch.PromptRows), if any

    def tolist(self) -> SampleOutput[list]:
        """The same rows as Python lists (of host tensors, once their copies have landed)."""
        rows = (self.tokens, self.logprobs, self.top_ids, self.top_logprobs)
        out = SampleOutput(*(None if t is None else t.tolist() for t in rows))
        if self.prompt is not None:
            out.prompt = self.prompt.tolist()
        return out


@dataclass
class PromptLogprobs(Generic[Rows]):
    """Each prompt row's next prompt token: its logprob and rank, and the row's top tokens."""

    logprobs: Rows  # [P]
    ranks: Rows  # [P] 1 = the likeliest token
    top_ids: Rows | None = None  # [P, K]
    top_logprobs: Rows | None = None  # [P, K]

    def map(self, f: Callable[[Rows], Rows2]) -> PromptLogprobs[Rows2]:
        return PromptLogprobs(*(None if t is None else f(t) for t in
                                (self.logprobs, self.ranks, self.top_ids, self.top_logprobs)))

    def tolist(self) -> PromptLogprobs[list]:
        return self.map(lambda t: t.tolist())


PROMPT_ROWS_AT_ONCE = 256  # rows of float32 log-softmax held at once: 128 MiB at a 128k vocabulary


def prompt_logprobs(
    logits: torch.Tensor, rows: PromptRows, targets: torch.Tensor
) -> PromptLogprobs[torch.Tensor]:
    """`logits`: [P, V] of the prompt rows; `targets`: [P] their next tokens, on the device. Taken
    a slice of rows at a time, so that a long prompt chunk needs no float32 copy of all its logits."""
    parts = []
    for start in range(0, len(targets), PROMPT_ROWS_AT_ONCE):
        logp = logits[start : start + PROMPT_ROWS_AT_ONCE].float().log_softmax(dim=-1)
        chosen = logp.gather(-1, targets[start : start + PROMPT_ROWS_AT_ONCE, None])
        part = [chosen[:, 0], (logp > chosen).sum(dim=-1) + 1]
        if rows.top > 0:
            values, ids = logp.topk(rows.top, dim=-1)
            part += [ids, values]
        parts.append(part)
    return PromptLogprobs(*(torch.cat(column) for column in zip(*parts, strict=True)))


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [S, V] with -inf for every token that a row's bitmask ([S, ceil(V / 32)] int32, bit
    i of word j = token 32 j + i; structured output's grammar.Grammars.fill) clears; set bits keep
    their logits as they are."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def sample(logits: torch.Tensor, st: SamplingTensors) -> SampleOutput[torch.Tensor]:
    # argmax is exact in the model's dtype (the upcast keeps order and ties): an all-greedy step
    # needs no float copy of the [rows, vocab] logits
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy and st.num_logprobs < 0:
        return SampleOutput(greedy_tokens)
    logits = logits.float()
    if st.all_greedy:
        tokens = greedy_tokens
    else:
        temperature = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
        scaled = logits / temperature[:, None]
        if st.needs_filter:
            scaled = _filter_top_k_top_p(scaled, st.top_k, st.top_p)
        gumbel = -torch.log(-torch.log(uniform_noise(st.seeds, st.steps, logits.shape[-1])))
        sampled = (scaled + gumbel).argmax(dim=-1)
        tokens = torch.where(st.temperature > 0, sampled, greedy_tokens)
    out = SampleOutput(tokens)
    if st.num_logprobs >= 0:
        # logprobs of the model's own distribution (before temperature and filtering), as vLLM reports
        logp = logits.log_softmax(dim=-1)
        out.logprobs = logp.gather(-1, tokens[:, None])[:, 0]
        if st.num_logprobs > 0:
            out.top_logprobs, out.top_ids = logp.topk(st.num_logprobs, dim=-1)
    return out
