"""What `tandem bench serve` reports of one level: throughput, latency percentiles and goodput, from
the requests as a client (or the engine alone) timed them, and how much of their prompts the prefix
cache held."""

from __future__ import annotations

from tandem.bench.common import percentile


def _ms(values: list[float]) -> dict[str, float | None]:
    out = {}
    for q in (50, 90, 99):
        v = percentile(values, q)
        out[f"p{q}"] = None if v is None else round(1e3 * v, 2)
    return out


def cached(done: list[dict]) -> dict:
    """Prompt tokens of the completed requests, and those the server found cached (None: a request
    without the server's word on it)."""
    counts = [r.get("cached_tokens") for r in done]
    return {"prompt_tokens": sum(r.get("prompt_tokens", 0) for r in done),
            "cached_prompt_tokens": None if None in counts else sum(counts)}


def summarize(requests: list[dict], slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Per-request dicts (start, first, end, tokens, messages, itl, error; wall-clock seconds;
    prompt_tokens and cached_tokens)."""
    done = [r for r in requests if r["error"] is None and r["first"] is not None]
    errors: dict[str, int] = {}
    for r in requests:
        if r["error"] is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    if not done:
        return {"requests": len(requests), "completed": 0, "errors": errors}
    t0 = min(r["start"] for r in requests)
    t1 = max(r["end"] for r in requests if r["end"] is not None)
    duration = t1 - t0
    ttft = [r["first"] - r["start"] for r in done]
    # the last token's arrival: the first plus every gap after it
    tpot = [sum(r["itl"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    itl = [g for r in done for g in r["itl"]]
    e2e = [r["end"] - r["start"] for r in done]
    tokens = sum(r["tokens"] for r in done)
    good = sum(
        1
        for r in done
        if r["first"] - r["start"] <= slo_ttft_s
        and (r["tokens"] <= 1 or sum(r["itl"]) / (r["tokens"] - 1) <= slo_tpot_s)
    )
    return {
        "requests": len(requests),
        "completed": len(done),
        "errors": errors,
        "seconds": round(duration, 3),
        "output_tok_s": round(tokens / duration, 1),
        "request_s": round(len(done) / duration, 3),
        "tokens": tokens,
        "tokens_per_message": round(tokens / max(1, sum(r["messages"] for r in done)), 2),
        "ttft_ms": _ms(ttft),
        "tpot_ms": _ms(tpot),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms(e2e),
        "goodput_request_s": round(good / duration, 3),
        "slo_attained": round(good / len(requests), 4),
        **cached(done),
    }
