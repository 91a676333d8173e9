"""Perplexity of a token sequence as the engine computes it.

The corpus is cut into windows; each window is one request (max_tokens 1) that the engine's own
scheduler prefills in chunks of its token budget, so every chunk after a window's first reads the
window's earlier K/V back from the paged cache: an FP8 cache's quantized K/V are what those rows
attend to. Each request asks for its prompt logprobs (`SamplingParams.prompt_logprobs`, as a
served request does: docs/api.md, "Evaluation"): the logprob of each next token of the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.bench.engine.harness import raise_failures
from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.engine_core import EngineCore


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
    """Score `ids` window by window, one window in the engine at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    result = Perplexity(0, 0, 0.0)
    for i, tokens in enumerate(windows(ids, window)):
        core.add(Request(f"window-{i}", tokens, params))
        scored = []
        while core.has_work:
            for out in raise_failures(core.run_once()).values():
                scored += [lp.logprob for _, logprobs in out.prompt_logprobs for lp in logprobs]
        assert len(scored) == len(tokens) - 1, "every next token of the window once"
        result.nll -= math.fsum(scored)
        result.tokens += len(scored)
        result.windows += 1
    return result


def through_model(model: object, ids: list[int], window: int) -> Perplexity:
    """Score `ids` window by window through a transformers model's own forward (each window from
    scratch, no engine): what the scripts that swap the model's attention function compare."""
    import torch

    result = Perplexity(0, 0, 0.0)
    with torch.no_grad():
        for tokens in windows(ids, window):
            batch = torch.tensor([tokens])
            result.nll += model(batch, labels=batch).loss.item() * (len(tokens) - 1)
            result.tokens += len(tokens) - 1
            result.windows += 1
    return result
