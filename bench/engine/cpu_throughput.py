"""`tandem bench cpu`: CPU throughput of Tandem's engine vs transformers' continuous batching on the
embedded SmolLM2-135M.

16 concurrent requests (16 different chat prompts, 30-90 tokens after the chat template) x 128 new
tokens each, greedy, fixed length (eos ignored / disabled), float32, torch.set_num_threads(2). Both
engines run the same model object in the same process; each gets a warm-up run, then `--repeat` timed
runs, interleaved; the fastest of each counts. Also reports how much CPU other processes took meanwhile.

    tandem bench cpu [--new 128] [--threads 2] [--repeat 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence

import torch

from tandem.bench.common import markdown_table
from tandem.bench.engine.harness import (
    RunStats,
    blocks_for,
    environment,
    measure,
    need_generate_batch,
    run_hf,
    run_tandem,
    same_outputs,
)
from tandem.bench.record import ResultFile
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.models.loader import load_model

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "Why is the sky blue? Answer in two sentences.",
    "Translate 'good morning, how are you today?' into Spanish and German.",
    "Give me a recipe for a simple tomato pasta sauce with garlic and basil.",
    "What are the main differences between a list and a tuple in Python? Give short examples of each.",
    "Summarise the plot of Romeo and Juliet for someone who has never read it.",
    "I have 3 apples and buy 5 more, then give away 2. How many apples do I have? Show your reasoning.",
    "Write a short, friendly email to a colleague asking to move our Tuesday meeting to Thursday afternoon.",
    "Describe the water cycle: evaporation, condensation, precipitation and collection, one line each.",
    "Suggest five names for a small bakery that specialises in sourdough bread and cinnamon rolls.",
    "You are a tour guide in Rome. In a few sentences, welcome a group of tourists and tell them what "
    "they will see today, including the Colosseum, the Forum and the Trevi Fountain.",
    "Compare cats and dogs as pets for a family living in a small city apartment, considering space, "
    "noise, time needed for care, cost and how they get on with young children. Be balanced.",
]
TANDEM_SPEC = dict(block_size=16, max_num_seqs=256, max_num_batched_tokens=2048)
# transformers' default block size (256); cache and token budget sized like Tandem's. On CPU it must be
# given explicitly: sized from memory it allocates (and zero-fills) static tensors for seconds per call.
HF_CONFIG = dict(block_size=256, max_batch_tokens=2048)


def _pct(share: float | None) -> str:
    return "?" if share is None else f"{share:.0%}"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-config", default=json.dumps(HF_CONFIG),
                    help="ContinuousBatchingConfig kwargs (JSON)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="timed rounds (each engine once, interleaved) after the warm-ups; best kept")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_cpu_cpu_smollm2-135m-16x<new>.json)")
    return ap.parse_args(argv)


def chat_prompts(tokenizer: object) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            for q in QUESTIONS]


def print_table(tandem: RunStats, hf: RunStats) -> None:
    rows = [[r.name, r.tokens, round(r.seconds, 2), round(r.tok_s, 1), r.steps or "-",
             round(1e3 * r.seconds / r.steps, 1) if r.steps else "-",
             " / ".join(f"{run['seconds']:.1f}" for run in r.all_runs), r.warmup_seconds, _pct(r.foreign_cpu),
             _pct(r.cpu_steal)] for r in (tandem, hf)]
    print(markdown_table(["engine", "tokens", "best s", "tokens/s", "steps", "ms/step", "all runs s",
                          "warm-up s", "other processes' CPU", "steal"], rows))
    busy = [r.name for r in (tandem, hf) if (r.foreign_cpu or 0) + (r.cpu_steal or 0) > 0.05]
    if busy:
        print(f"WARNING: other processes or the hypervisor took CPU during: {', '.join(busy)}; unreliable")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    need_generate_batch("cpu")
    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    loaded = load_model(None, None, device)  # embedded SmolLM2-135M-Instruct, float32
    prompts = chat_prompts(loaded.tokenizer)
    result_file = ResultFile("cpu", argv, device, f"smollm2-135m-{len(prompts)}x{a.new}", a.out)
    longest = max(map(len, prompts)) + a.new
    blocks = blocks_for(len(prompts), longest, TANDEM_SPEC["block_size"])
    spec = EngineConfig(num_blocks=blocks, **TANDEM_SPEC)
    hf_config = json.loads(a.hf_config)
    hf_config.setdefault("num_blocks", blocks_for(len(prompts), longest, hf_config.get("block_size", 256)))

    hf_model = copy.deepcopy(loaded.model)  # transformers runs its own model, untouched by the engine
    core = build_core(loaded.model, spec)  # fuses the projections of its model in place
    results = measure({
        "tandem": lambda: run_tandem(core, prompts, a.new),
        "transformers": lambda: run_hf(hf_model, prompts, a.new, hf_config),
    }, a.repeat)
    tandem, hf = results["tandem"], results["transformers"]

    ratio = tandem.tok_s / hf.tok_s
    result = {
        "benchmark": "cpu_throughput",
        "model": loaded.name,
        "dtype": str(next(loaded.model.parameters()).dtype),
        "workload": {
            "requests": len(prompts),
            "prompts": "16 different chat prompts through the chat template",
            "prompt_tokens": [len(p) for p in prompts],
            "new_tokens": a.new,
            "sampling": "greedy, fixed length",
        },
        "environment": environment(device),
        "tandem": {**tandem.summary(), "engine": spec.__dict__},
        "transformers": {**hf.summary(), "continuous_batching_config": hf_config,
                         "attn_implementation": "paged|sdpa"},
        "ratio_tandem_over_transformers": round(ratio, 2),
        "target_ratio": 2.0,
        "identical_outputs": f"{same_outputs(tandem, hf)}/{len(prompts)}",
    }
    out = result_file.write(result)
    print_table(tandem, hf)
    print(f"\nTandem / transformers = {ratio:.2f}x (target >= 2x); identical greedy outputs: "
          f"{result['identical_outputs']}; prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
