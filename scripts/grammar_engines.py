"""xgrammar against llguidance on the served tokenizer: what structured output costs in each.

For a few JSON schemas (nested objects, enums, arrays, bounded numbers) it measures, each engine in
a process of its own: the one-off tokenizer preparation, a grammar's compile time (no cache), the
per-token time of a decode step's grammar work (fill the next-token bitmask, then accept the token)
while matching a valid instance token by token, and the memory the process grew by (resident, after
torch and the tokenizer are loaded).

    python scripts/grammar_engines.py                      # the embedded SmolLM2 tokenizer
    python scripts/grammar_engines.py --tokenizer DIR --repeat 5
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SCHEMAS: dict[str, tuple[dict, object]] = {
    "nested_object": (
        {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "geo": {"type": "object",
                        "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False}},
                "required": ["street", "city", "geo"], "additionalProperties": False}},
         "required": ["name", "age", "address"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "address": {"street": "12 St James's Square", "city": "London",
                                                        "geo": {"lat": 51.507, "lon": -0.134}}},
    ),
    "enums": (
        {"type": "object", "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral", "mixed"]},
            "language": {"enum": ["en", "fr", "de", "es", "it", "pt", "nl", "sv", "pl", "ja", "zh"]},
            "topic": {"type": "string", "enum": ["billing", "shipping", "returns", "account", "other"]},
            "urgent": {"type": "boolean"}},
         "required": ["sentiment", "language", "topic", "urgent"], "additionalProperties": False},
        {"sentiment": "mixed", "language": "fr", "topic": "returns", "urgent": False},
    ),
    "array": (
        {"type": "object", "properties": {
            "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
                "type": "object", "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "quantity"], "additionalProperties": False}},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}},
         "required": ["items", "tags"], "additionalProperties": False},
        {"items": [{"sku": "ABC-1234", "quantity": 3}, {"sku": "XYZ-0042", "quantity": 12}],
         "tags": ["gift", "express"]},
    ),
    "bounded_numbers": (
        {"type": "object", "properties": {
            "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "pressure_hpa": {"type": "integer", "minimum": 870, "maximum": 1085},
            "wind": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 120},
                     "minItems": 3, "maxItems": 3}},
         "required": ["temperature_c", "humidity", "pressure_hpa", "wind"], "additionalProperties": False},
        {"temperature_c": -3.5, "humidity": 81, "pressure_hpa": 1013, "wind": [4.2, 7.0, 11.5]},
    ),
}


def _rss_mib() -> float:
    """The process's resident memory now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _tokenizer(path: str | None) -> tuple[object, str]:
    from transformers import AutoTokenizer

    if path is None:
        from tandem.service.models.default_model import default_gguf_path
        from tandem.service.models.loader import convert_gguf, default_cache_dir

        path = str(convert_gguf(default_gguf_path(), default_cache_dir()))
    return AutoTokenizer.from_pretrained(path), path


def _timed(f: object, repeat: int) -> tuple[float, object]:
    """-> (median seconds of `repeat` calls, the last call's result)."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def run_xgrammar(tok: object, repeat: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    prepare_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    out = {"engine": "xgrammar", "tokenizer_prepare_ms": prepare_s * 1e3, "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        def compile_once(schema: dict = schema) -> object:
            compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
            return compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":"))

        compile_s, compiled = _timed(compile_once, repeat)
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        matcher = xgr.GrammarMatcher(compiled)
        per_token = []
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(t), f"{name}: token {t} refused"
            per_token.append(time.perf_counter() - t0)
        matcher.fill_next_token_bitmask(bitmask)
        allowed_eos = bool((bitmask[0, tok.eos_token_id // 32] >> (tok.eos_token_id % 32)) & 1)
        out["schemas"][name] = _schema_result(compile_s, per_token, allowed_eos, compiled.memory_size_bytes)
    out["rss_mib"] = _rss_mib()
    return out


def run_llguidance(tok: object, repeat: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    prepare_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, len(tok))
    out = {"engine": "llguidance", "tokenizer_prepare_ms": prepare_s * 1e3, "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})

        def compile_once(grammar: str = grammar) -> object:
            matcher = llguidance.LLMatcher(lltok, grammar)
            assert not matcher.is_error(), matcher.get_error()
            return matcher

        compile_s, matcher = _timed(compile_once, repeat)
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        per_token = []
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            assert matcher.consume_token(t), f"{name}: token {t} refused: {matcher.get_error()}"
            per_token.append(time.perf_counter() - t0)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        allowed_eos = bool((bitmask[0, tok.eos_token_id // 32] >> (tok.eos_token_id % 32)) & 1)
        out["schemas"][name] = _schema_result(compile_s, per_token, allowed_eos, None)
    out["rss_mib"] = _rss_mib()
    return out


def _schema_result(compile_s: float, per_token: list[float], allowed_eos: bool, size: int | None) -> dict:
    per_token_us = sorted(t * 1e6 for t in per_token)
    return {
        "compile_ms": compile_s * 1e3,
        "tokens": len(per_token),
        "mask_accept_us_mean": statistics.fmean(per_token_us),
        "mask_accept_us_p50": per_token_us[len(per_token_us) // 2],
        "mask_accept_us_max": per_token_us[-1],
        "eos_allowed_at_end": allowed_eos,
        "compiled_bytes": size,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a transformers tokenizer folder (default: the embedded model's)")
    parser.add_argument("--repeat", type=int, default=3, help="compiles per schema (the median is kept)")
    parser.add_argument("--engine", choices=["xgrammar", "llguidance"], help="(internal) one engine, here")
    args = parser.parse_args()
    if args.engine is not None:  # the child: one engine in a fresh process, so its peak RSS is its own
        tok, _ = _tokenizer(args.tokenizer)
        import torch  # noqa: F401 - both engines' glue imports it: its memory is not theirs

        base = _rss_mib()
        result = (run_xgrammar if args.engine == "xgrammar" else run_llguidance)(tok, args.repeat)
        result["rss_growth_mib"] = result.pop("rss_mib") - base
        print(json.dumps(result))
        return 0
    _, path = _tokenizer(args.tokenizer)
    results = []
    for engine in ("xgrammar", "llguidance"):
        cmd = [sys.executable, __file__, "--engine", engine, "--tokenizer", path,
               "--repeat", str(args.repeat)]
        results.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    print(json.dumps({"tokenizer": path, "results": results}, indent=1))
    print(f"\n{'schema':<16} {'engine':<11} {'compile ms':>10} {'mask+accept us (mean/p50/max)':>30}")
    for r in results:
        for name, s in r["schemas"].items():
            times = (s["mask_accept_us_mean"], s["mask_accept_us_p50"], s["mask_accept_us_max"])
            print(f"{name:<16} {r['engine']:<11} {s['compile_ms']:>10.1f} "
                  f"{times[0]:>12.0f} {times[1]:>8.0f} {times[2]:>8.0f}")
    for r in results:
        print(f"{r['engine']}: tokenizer prepared in {r['tokenizer_prepare_ms']:.0f} ms, "
              f"process grew by {r['rss_growth_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
