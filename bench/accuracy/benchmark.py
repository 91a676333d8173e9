"""`tandem bench accuracy`: perplexity and greedy agreement of FP8 variants against bf16, through
the engine.

Each variant is the model loaded afresh in its dtype with the engine's FP8 settings (variants.py):
fp32 (a reference), bf16 (the baseline), w8a8 (quantization fp8), kv8 (kv_cache_dtype fp8) and
w8a8+kv8. For each: the perplexity of the shipped corpus (data.py), scored in windows that the
engine prefills in chunks, later chunks reading earlier K/V from the paged cache (perplexity.py);
then every prompt's greedy answer through the engine core, compared with bf16's (agreement.py).
Targets: perplexity within +3% of bf16 for w8a8, +1% for kv8. A variant this build cannot run is
reported as unavailable. --smoke: a tiny random model on bytes, seconds; checks the logic only.

    tandem bench accuracy [--variants fp32,bf16,w8a8,kv8,w8a8+kv8] [--device cpu|cuda] [--model DIR]
                          [--window 1024] [--chunk 256] [--new 64] [--threads 2] [--out F] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tandem.bench.accuracy import data, perplexity
from tandem.bench.accuracy.agreement import agreement, greedy
from tandem.bench.accuracy.variants import BASELINE, VARIANTS, Unavailable, build
from tandem.bench.common import markdown_table, need_cuda
from tandem.bench.engine.harness import blocks_for
from tandem.bench.record import ResultFile
from tandem.service.engine.config import EngineConfig

TARGETS = {"w8a8": 1.03, "kv8": 1.01}  # most perplexity a variant may have, over bf16's
SMOKE = dict(window=64, chunk=16, new=8, prompts=8, corpus_tokens=256)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"some of {', '.join(VARIANTS)}; bf16 always runs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default=None,
                    help="a transformers model directory or .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    ap.add_argument("--chunk", type=int, default=256,
                    help="the engine's token budget per step: a window's prefill chunk")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--corpus-tokens", type=int, default=None, help="score the corpus's first N tokens only")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_<gpu>_accuracy_<model>.json)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model on bytes, few tokens: checks the logic")
    a = ap.parse_args(argv)
    if a.smoke:
        for key, value in SMOKE.items():
            if getattr(a, key) in (None, ap.get_default(key)):
                setattr(a, key, value)
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    if unknown := [n for n in names if n not in VARIANTS]:
        ap.error(f"unknown variants {unknown}: expected some of {', '.join(VARIANTS)}")
    a.variants = [BASELINE] + [n for n in names if n != BASELINE]  # the baseline first: the others need it
    return a


def model_source(a: argparse.Namespace, device: torch.device
                 ) -> tuple[Callable[[torch.dtype], torch.nn.Module], data.Tokenizer | None, str]:
    """-> (a loader of the model in a dtype, its tokenizer (None: bytes), the model's short name)."""
    if a.smoke:
        from tandem.bench.engine.variants import build_model

        return lambda dtype: build_model("tiny", device, torch.float32).to(dtype), None, "tiny"
    from tandem.service.models.loader import load_model

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    tokenizer = load_model(a.model, None, device, "bfloat16").tokenizer
    name = "smollm2-135m" if a.model is None else Path(a.model).stem.lower()
    return lambda dtype: load_model(a.model, None, device, names[dtype]).model, tokenizer, name


def run_variant(name: str, load: Callable, spec: EngineConfig, corpus: list[int], prompts: list[list[int]],
                a: argparse.Namespace) -> dict:
    """One variant's measurements, or why it is unavailable."""
    variant = VARIANTS[name]
    facts = {"dtype": str(variant.dtype).removeprefix("torch."), "quantization": variant.quantization,
             "kv_cache_dtype": variant.kv_cache_dtype}
    start = time.perf_counter()
    try:
        core = build(variant, load, spec)
    except Unavailable as why:
        print(f"{name}: {why}", flush=True)
        return {**facts, "available": False, "why": str(why)}
    ppl = perplexity.measure(core, corpus, a.window)
    print(f"{name}: perplexity {ppl.perplexity:.4f} over {ppl.tokens} tokens", flush=True)
    answers = greedy(core, prompts, a.new)
    return {**facts, "available": True, "perplexity": ppl.summary(), "answers": answers,
            "seconds": round(time.perf_counter() - start, 1)}


def compare(variants: dict[str, dict]) -> None:
    """Each available variant's perplexity ratio and greedy agreement to the baseline's, its target."""
    base = variants[BASELINE]
    for name, v in variants.items():
        if not v["available"]:
            continue
        v["ratio_to_bf16"] = round(v["perplexity"]["perplexity"] / base["perplexity"]["perplexity"], 4)
        v["greedy"] = agreement(v["answers"], base["answers"])
        if name in TARGETS:
            v["target_ratio"] = TARGETS[name]
            v["target_met"] = v["ratio_to_bf16"] <= TARGETS[name]


def table(record: dict) -> str:
    rows = []
    for name, v in record["variants"].items():
        if not v["available"]:
            rows.append([name, *["-"] * 6, v["why"]])
            continue
        p, g = v["perplexity"], v["greedy"]
        target = ""
        if "target_ratio" in v:
            target = f"<= {v['target_ratio']}: {'met' if v['target_met'] else 'NOT met'}"
        rows.append([name, f"{p['perplexity']:.3f}", f"{p['nll_per_token']:.4f}", f"{v['ratio_to_bf16']:.4f}",
                     f"{g['identical']:.0%}",
                     g["mean_common_prefix"], f"{g['first_token']:.0%}", target])
    return markdown_table(["variant", "perplexity", "NLL/token", "ratio to bf16",
                           f"identical {record['prompts']['new_tokens']} tokens", "mean common prefix",
                           "same first token", "target"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.device == "cuda":
        need_cuda("accuracy")
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    load, tokenizer, model_name = model_source(a, device)
    corpus = data.corpus_ids(tokenizer)[: a.corpus_tokens]
    prompts = data.prompt_ids(tokenizer)[: a.prompts]
    longest = max(map(len, prompts)) + a.new
    blocks = max(blocks_for(1, a.window + 1, 16), blocks_for(len(prompts), longest, 16))
    # no CUDA graphs: every step runs the eager forward (graphs replay the same forward, so the
    # numbers are those of graphed steps)
    spec = EngineConfig(num_blocks=blocks, max_num_seqs=len(prompts), max_num_batched_tokens=a.chunk,
                        cuda_graphs=False)
    shape = f"{model_name}{'-smoke' if a.smoke else ''}"
    folder = tempfile.gettempdir() if a.smoke else None  # a smoke run's numbers are no result
    result_file = ResultFile("accuracy", argv, device, shape, a.out, folder)
    variants = {name: run_variant(name, load, spec, corpus, prompts, a) for name in a.variants}
    compare(variants)
    record = {"benchmark": "accuracy", "model": model_name, "smoke": a.smoke, "threads": a.threads,
              "corpus": {"file": "bench/accuracy/corpus.txt", "tokens": len(corpus), "window": a.window,
                         "chunk": a.chunk},
              "prompts": {"file": "bench/accuracy/prompts.txt", "count": len(prompts), "new_tokens": a.new},
              "engine": {k: v for k, v in spec.__dict__.items() if k in ("num_blocks", "block_size",
                                                                           "max_num_batched_tokens")},
              "variants": variants}
    out = result_file.write(record, table)
    print(table(record))
    print(f"wrote {out}")
    return 0
