"""`tandem bench structured`: what structured output costs the engine. The same closed-loop workload
(`--streams` requests in flight at every step, each finished one replaced at once, until
`--requests` have finished) runs constrained by a JSON schema and unconstrained, in the same process
on the same model; tokens/s of each and their ratio. Sampling at temperature 1 with a seed per
request; an unconstrained request generates as many tokens as the constrained one of its index did
(ignore_eos), so both runs make the same number of tokens, in batches of the same sizes. Then, on
the idle engine, the time to the first token of a request whose schema is new (its grammar compiled
first) against the same schema again (cached), `--first-time` times each, alternating. Each run's
steps and mean step time, and the constrained run's host time in grammar work per step (filling the
masks, the matchers accepting tokens), say how much of a gap between the two the host explains.

    tandem bench structured                         # the embedded SmolLM2-135M, 64 streams
    tandem bench structured --model DIR --streams 256 --requests 1024 --device cuda
    tandem bench structured --shape 8b --tokenizer DIR --streams 256 --requests 1024   # random weights
    tandem bench structured --smoke                 # a few requests, to check it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.bench.common import SHAPES
from tandem.bench.engine.harness import blocks_for, environment, raise_failures
from tandem.bench.record import ResultFile
from tandem.service.contract import Request, SamplingParams, StructuredOutput
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.grammar import Grammars, GrammarState
from tandem.service.models.loader import load_model
from tandem.service.structured_output import canonical_schema

SCHEMA = {  # an extraction record: nested object, enum, bounded numbers and strings, an array
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "category": {"enum": ["billing", "shipping", "returns", "account", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "customer": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
            "country": {"type": "string", "maxLength": 2, "minLength": 2}},
            "required": ["id", "country"], "additionalProperties": False},
        "amounts": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10000},
                    "maxItems": 4},
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["name", "category", "priority", "customer", "amounts", "summary"],
    "additionalProperties": False,
}
PROMPT = ("Extract the ticket as JSON: 'Hi, this is Dana Whitfield (customer DE104233, Germany). I was "
          "charged twice, 49.90 and 49.90, for order 1182. Please refund one of them soon.'")


def closed_loop(core: EngineCore, prompt: list[int], streams: int, requests: int,
                params_of: Callable[[int], SamplingParams]) -> tuple[float, list[list[int]]]:
    """`streams` requests in flight (request i with `params_of(i)`) until `requests` have finished;
    -> (seconds, each request's tokens)."""
    outputs: list[list[int]] = [[] for _ in range(requests)]
    submitted = finished = 0

    def submit() -> None:
        nonlocal submitted
        core.add(Request(str(submitted), list(prompt), params_of(submitted)))
        submitted += 1

    start = time.perf_counter()
    while submitted < min(streams, requests):
        submit()
    while core.has_work:
        for out in raise_failures(core.run_once()).values():
            done = {row for row, *_ in out.finished}
            for row, (rid, token) in enumerate(zip(out.request_ids, out.tokens, strict=True)):
                outputs[int(rid)].append(token)
                if row in done:
                    finished += 1
                    if submitted < requests:
                        submit()
    if finished != requests:
        raise RuntimeError(f"{finished} of {requests} requests finished")
    return time.perf_counter() - start, outputs


class GrammarClock:
    """The host's grammar work while it is entered: the masks' fills (`Grammars.fill`) and the
    tokens the matchers accept (`GrammarState.accept`), timed by wrapping them."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self.fill_s = self.accept_s = 0.0

    def __enter__(self) -> GrammarClock:
        fill, accept = self.grammars.fill, GrammarState.accept

        def timed_fill(*args: object, **kwargs: object) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return fill(*args, **kwargs)
            finally:
                self.fill_s += time.perf_counter() - start

        def timed_accept(state: GrammarState, token: int) -> bool:
            start = time.perf_counter()
            try:
                return accept(state, token)
            finally:
                self.accept_s += time.perf_counter() - start

        self._accept = accept
        self.grammars.fill = timed_fill  # type: ignore[method-assign]
        GrammarState.accept = timed_accept  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.grammars.fill  # the class's own again
        GrammarState.accept = self._accept  # type: ignore[method-assign]


def first_token_seconds(core: EngineCore, request_id: str, prompt: list[int],
                        params: SamplingParams) -> float:
    """From submitting one request to an idle engine to its first token (max_tokens 1: it ends there)."""
    start = time.perf_counter()
    core.add(Request(request_id, list(prompt), params))
    while core.has_work:
        for out in raise_failures(core.run_once()).values():
            if request_id in out.request_ids:
                seconds = time.perf_counter() - start
                while core.has_work:  # what the step loop still holds of it
                    raise_failures(core.run_once())
                return seconds
    raise RuntimeError(f"request {request_id} gave no token")


def schema_variant(i: int) -> dict:
    """SCHEMA with its summary's bound moved by `i`: a schema the engine has not compiled yet."""
    summary = {"type": "string", "maxLength": 121 + i}
    return {**SCHEMA, "properties": {**SCHEMA["properties"], "summary": summary}}


def first_time_ttft(core: EngineCore, prompt: list[int], n: int) -> dict:
    """Median time to first token of `n` requests with a new schema each, and of the same schemas
    again (their grammars cached), alternating; milliseconds and their ratio."""
    fresh, cached = [], []
    compiled = core.grammars.compiled
    for i in range(n):
        constraint = StructuredOutput(json_schema=canonical_schema(schema_variant(i)))
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=1, structured_output=constraint)
        fresh.append(first_token_seconds(core, f"first-{i}", prompt, params))
        cached.append(first_token_seconds(core, f"again-{i}", prompt, params))
    median_fresh, median_cached = statistics.median(fresh), statistics.median(cached)
    return {"requests": n, "first_time_ms": round(1e3 * median_fresh, 2),
            "cached_ms": round(1e3 * median_cached, 2), "ratio": round(median_fresh / median_cached, 3),
            "grammar_compiles": core.grammars.compiled - compiled}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench structured", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--model", help="a transformers model directory (default: the embedded SmolLM2-135M)")
    where.add_argument("--shape", choices=sorted(SHAPES),
                       help="a random-initialised Llama of this shape (bf16 on CUDA) and a real tokenizer")
    ap.add_argument("--tokenizer", help="with --shape: its tokenizer (default: the embedded model's)")
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: torch's)")
    ap.add_argument("--first-time", type=int, default=8,
                    help="requests with a new schema (and as many with the same again) for the TTFT ratio")
    ap.add_argument("--smoke", action="store_true", help="8 streams, 16 requests: checks that it runs")
    ap.add_argument("--out", help="JSON path (default: bench/results/ under the standard name)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.smoke:
        args.streams, args.requests, args.max_tokens, args.first_time = 8, 16, 48, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.shape:
        model, tokenizer, eos, name = _shaped(args.shape, args.tokenizer, device)
    else:
        loaded = load_model(args.model, None, device, args.dtype)
        model, tokenizer, eos, name = loaded.model, loaded.tokenizer, loaded.eos_token_ids, loaded.name
    config = EngineConfig(
        num_blocks=blocks_for(args.streams, 256 + args.max_tokens, 16), block_size=16,
        max_num_seqs=max(args.streams, 8), max_num_batched_tokens=2048, step_loop="auto",
        compile_decode=device.type == "cuda", compile_prefill=device.type == "cuda",
        fuse_projections=device.type == "cuda", fold_rotary=device.type == "cuda",
    )
    core = build_core(model, config, eos)
    vocab = model.config.get_text_config().vocab_size
    core.grammars = Grammars(tokenizer, vocab, eos, pin_memory=device.type == "cuda",
                             threads=4 if device.type == "cuda" else 1)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)
    prompt = list(chat["input_ids"])
    constraint = StructuredOutput(json_schema=canonical_schema(SCHEMA))

    def constrained(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                              structured_output=constraint)

    warm = min(args.streams, 8)
    closed_loop(core, prompt, warm, warm, constrained)  # compiles the grammar, warms the step shapes
    steps = core.steps
    with GrammarClock(core.grammars) as clock:
        seconds_c, outs = closed_loop(core, prompt, args.streams, args.requests, constrained)
    steps_c = core.steps - steps
    lengths = [len(o) for o in outs]
    parsed = sum(_parses(tokenizer, o, eos) for o in outs)

    def free(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=lengths[i], ignore_eos=True)

    closed_loop(core, prompt, warm, warm, free)
    steps = core.steps
    seconds_f, outs_f = closed_loop(core, prompt, args.streams, args.requests, free)
    steps_f = core.steps - steps
    tokens = sum(lengths)
    assert tokens == sum(len(o) for o in outs_f)
    compiles = core.grammars.compiled  # the throughput runs': their one schema
    ttft = first_time_ttft(core, prompt, args.first_time)
    result = {
        "benchmark": "structured", "smoke": args.smoke, "model": name, "streams": args.streams,
        "requests": args.requests,
        "tokens": tokens, "mean_length": round(tokens / args.requests, 1),
        "constrained_tok_s": round(tokens / seconds_c, 1),
        "unconstrained_tok_s": round(tokens / seconds_f, 1),
        "ratio": round(seconds_f / seconds_c, 3), "parsed": f"{parsed}/{args.requests}",
        "steps": {"constrained": steps_c, "unconstrained": steps_f},
        "ms_per_step": {"constrained": round(1e3 * seconds_c / steps_c, 3),
                        "unconstrained": round(1e3 * seconds_f / steps_f, 3)},
        "host_grammar_ms_per_step": {"fill": round(1e3 * clock.fill_s / steps_c, 3),
                                     "accept": round(1e3 * clock.accept_s / steps_c, 3)},
        "grammar_compiles": compiles, "first_time_schema_ttft": ttft,
        "environment": environment(device),
    }
    print(json.dumps(result, indent=1))
    print(f"\n{args.streams} streams, {tokens} tokens: constrained {result['constrained_tok_s']} tok/s, "
          f"unconstrained {result['unconstrained_tok_s']} tok/s, ratio {result['ratio']:.3f}; "
          f"{result['parsed']} constrained outputs parse; a step {result['ms_per_step']['constrained']} "
          f"against {result['ms_per_step']['unconstrained']} ms, of it the host's grammar work "
          f"{result['host_grammar_ms_per_step']['fill']} ms filling masks and "
          f"{result['host_grammar_ms_per_step']['accept']} ms accepting tokens; "
          f"TTFT on the idle engine with a new schema "
          f"{ttft['first_time_ms']} ms, with a cached one {ttft['cached_ms']} ms ({ttft['ratio']:.2f}x)")
    run_name = f"{name}-{args.streams}x{args.requests}"
    path = ResultFile("structured", argv, device, run_name, args.out).write(result)
    print(f"wrote {path}")
    return 0


def _shaped(shape: str, tokenizer_dir: str | None, device: torch.device
            ) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, frozenset[int], str]:
    """A random-initialised Llama of `shape` (bf16 on CUDA) and a real tokenizer. The model keeps its
    shape's vocabulary where that holds the tokenizer's (the masks are that wide; the grammars allow
    only the tokenizer's tokens), and takes the tokenizer's where it is smaller (the tiny shape)."""
    from tandem.bench.engine.variants import build_model
    from tandem.bench.serve.server import default_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or default_tokenizer())
    vocab = max(SHAPES[shape]["vocab_size"], len(tokenizer))
    model = build_model(shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32, vocab)
    return model, tokenizer, frozenset({tokenizer.eos_token_id}), f"random-{shape}"


def _parses(tokenizer: object, tokens: list[int], eos: frozenset[int]) -> bool:
    text = tokenizer.decode([t for t in tokens if t not in eos])
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
