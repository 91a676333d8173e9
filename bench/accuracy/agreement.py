"""Greedy agreement: each variant's greedy tokens for the fixed prompts, through the engine core
(every prompt at once, continuous batching as served), against the baseline's."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.bench.engine.harness import run_tandem
from tandem.service.engine.engine_core import EngineCore


def greedy(core: EngineCore, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's first `new_tokens` greedy tokens (end of sequence ignored: every answer has
    the same length, so answers compare token by token)."""
    return run_tandem(core, prompts, new_tokens, tag="greedy-").outputs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """Share of prompts whose answer equals the reference's, share whose first token does, and the
    mean length of the common prefix (in tokens, out of the answers' length)."""
    prefixes = [common_prefix(t, r) for t, r in zip(tokens, reference, strict=True)]
    length = len(reference[0])
    return {
        "prompts": len(prefixes),
        "new_tokens": length,
        "identical": round(sum(p == length for p in prefixes) / len(prefixes), 4),
        "first_token": round(sum(p > 0 for p in prefixes) / len(prefixes), 4),
        "mean_common_prefix": round(sum(prefixes) / len(prefixes), 2),
    }
