"""Perplexity of a token sequence as the engine computes it.

The corpus is cut into windows; each window is one request (max_tokens 1) that the engine's own
scheduler prefills in chunks of its token budget, so every chunk after a window's first reads the
window's earlier K/V back from the paged cache: an FP8 cache's quantized K/V are what those rows
attend to. A step keeps only its sampled rows' logits; `EveryRow` has the runner's forward keep
every row for the duration of a measurement and hands the sampled rows on as before, so the
engine's step (scheduler, step inputs, attention ops, cache writes, sampling) runs unchanged. The
rows' logits score each next token of the window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tandem.bench.engine.harness import raise_failures
from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.engine_core import EngineCore


class EveryRow:
    """While entered, the runner's forwards compute every row's logits; each step's positions and
    float32 logits ([T], [T, vocab]) land in `steps`."""

    def __init__(self, core: EngineCore) -> None:
        self.runner = core.runner
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._saved: tuple[Callable, Callable] | None = None

    def __enter__(self) -> EveryRow:
        r = self.runner
        self._saved = (r.prefill_forward, r.decode_forward)
        r.prefill_forward, r.decode_forward = self._wrap(r.prefill_forward), self._wrap(r.decode_forward)
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.prefill_forward, self.runner.decode_forward = self._saved

    def _wrap(self, forward: Callable[..., object]) -> Callable[..., object]:
        def every_row(*, logits_to_keep: torch.Tensor | int, **kwargs: object) -> SimpleNamespace:
            logits = forward(logits_to_keep=0, **kwargs).logits  # [1, T, vocab]
            # a copy: the positions are a view of the step slot's buffer, which later steps refill
            self.steps.append((kwargs["position_ids"][0].to("cpu", copy=True), logits[0].float().cpu()))
            if isinstance(logits_to_keep, int):  # transformers' meaning: the last n rows, 0 = all
                return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)
            return SimpleNamespace(logits=logits[:, logits_to_keep])

        return every_row


@dataclass
class Perplexity:
    tokens: int  # scored (each window's first token has no context and is not)
    windows: int
    nll: float  # summed over the scored tokens, in nats

    @property
    def nll_per_token(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_per_token)

    def summary(self) -> dict:
        return {"tokens": self.tokens, "windows": self.windows, "nll_per_token": round(self.nll_per_token, 6),
                "perplexity": round(self.perplexity, 4)}


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of `size` tokens; a last one shorter than 2 tokens scores nothing."""
    return [ids[i : i + size] for i in range(0, len(ids), size) if len(ids[i : i + size]) >= 2]


def measure(core: EngineCore, ids: list[int], window: int) -> Perplexity:
    """Score `ids` window by window, one window in the engine at a time (so every step's rows are
    that window's, in order)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    result = Perplexity(0, 0, 0.0)
    for i, tokens in enumerate(windows(ids, window)):
        target = torch.tensor(tokens)
        with EveryRow(core) as tap:
            core.add(Request(f"window-{i}", tokens, params))
            while core.has_work:
                raise_failures(core.run_once())
        seen = torch.cat([positions for positions, _ in tap.steps])
        assert torch.equal(seen, torch.arange(len(tokens))), "every position of the window once, in order"
        for positions, logits in tap.steps:
            scored = positions < len(tokens) - 1  # the last position predicts past the window
            logprobs = torch.log_softmax(logits[scored], dim=-1)
            nexts = target[positions[scored] + 1]
            result.nll -= float(logprobs.gather(1, nexts[:, None]).sum(dtype=torch.float64))
            result.tokens += int(scored.sum())
        result.windows += 1
    return result
