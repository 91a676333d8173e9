"""What a constrained step's grammar work costs the host: `--rows` matchers of `tandem bench
structured`'s schema, each step their next-token bitmasks filled (xgrammar's batch fill, `--threads`)
and one allowed token each accepted, with xgrammar told the model's vocabulary (`--vocab`, padded
past the tokenizer's ids) and told the tokenizer's ids only (as the engine's grammar.Grammars does).
Also the schema's compile time for each.

    python scripts/grammar_step_cost.py                        # the embedded tokenizer, 128,256 ids
    python scripts/grammar_step_cost.py --tokenizer DIR --rows 256 --threads 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from tandem.bench.engine.structured import SCHEMA
from tandem.bench.serve.server import default_tokenizer
from tandem.service.contract import StructuredOutput
from tandem.service.engine.grammar import tokenizer_ids
from tandem.service.structured_output import build, canonical_schema


def allowed_tokens(row: torch.Tensor, limit: int) -> list[int]:
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return torch.nonzero(bits[:limit]).flatten().tolist()


def step_costs(tokenizer, vocab: int, rows: int, threads: int, steps: int) -> dict:  # noqa: ANN001
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                              stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammar = build(StructuredOutput(json_schema=canonical_schema(SCHEMA)))
    compiles = []
    for _ in range(5):
        start = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        compiles.append(time.perf_counter() - start)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    mask = torch.empty((rows, (vocab + 31) // 32), dtype=torch.int32)
    rng = random.Random(0)
    fill, accept = [], []
    for _ in range(steps):
        live = [m for m in matchers if not m.is_terminated()]
        if not live:
            break
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(live, mask[: len(live)], list(range(len(live))))
        fill.append(time.perf_counter() - start)
        tokens = []
        for i in range(len(live)):
            allowed = allowed_tokens(mask[i], min(vocab, len(tokenizer)))
            tokens.append(rng.choice(allowed) if allowed else tokenizer.eos_token_id)
        start = time.perf_counter()
        xgr.BatchGrammarMatcher.batch_accept_token(live, tokens)
        accept.append(time.perf_counter() - start)
    return {"xgrammar_vocab": vocab, "special_ids": len(info.special_token_ids),
            "compile_ms": round(1e3 * statistics.median(compiles), 2),
            "fill_ms_per_step": round(1e3 * statistics.mean(fill), 2),
            "accept_ms_per_step": round(1e3 * statistics.mean(accept), 2),
            "steps": len(fill)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded model's)")
    ap.add_argument("--vocab", type=int, default=128256, help="the model's vocabulary (the 8B shape's)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or default_tokenizer())
    told = (("the model's vocabulary", a.vocab), ("the tokenizer's ids", tokenizer_ids(tokenizer)))
    for name, vocab in told:
        print(name, step_costs(tokenizer, vocab, a.rows, a.threads, a.steps), flush=True)


if __name__ == "__main__":
    main()
