"""What `tandem bench serve` makes of its levels: the markdown tables (server against the engine
alone; HTTP against gRPC), the cached prompt tokens of each pass, and the figure."""

from __future__ import annotations

from pathlib import Path

ENGINE_PASS = 0  # the engine alone's pass; the server's are numbered from 1


def label(level: dict) -> str:
    if level["mode"] == "concurrency":
        what = f"{level['concurrency']} streams"
    else:
        what = f"{level['request_rate']} req/s"
    if level.get("front", "grpc") != "grpc":
        what += f", {level['front'].upper()}"
    if level.get("api_processes", 1) != 1:
        what += f", {level['api_processes']} fronts"
    if level.get("transport", "plaintext") != "plaintext":
        what += f", {level['transport']}"
    if "prefix_caching" in level:
        what += f", prefix caching {'on' if level['prefix_caching'] else 'off'}"
    return what


def table(rows: list[dict]) -> str:
    head = [
        "level",
        "server tok/s",
        "engine tok/s",
        "server / engine",
        "engine median step ms",
        "TTFT p50 / p99 ms",
        "TPOT p50 / p99 ms",
        "ITL p50 / p99 ms",
        "tokens / message",
        "goodput req/s",
        "GPU idle (server)",
        "cached / prompt tokens",
        "errors",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s, e = r["server"], r.get("engine") or {}

        def pair(d: dict, key: str) -> str:
            v = d.get(key) or {}
            return f"{v.get('p50')} / {v.get('p99')}" if v else "-"

        lines.append(
            "| "
            + " | ".join(
                str(x)
                for x in [
                    label(r),
                    s.get("output_tok_s"),
                    e.get("output_tok_s", "-"),
                    r.get("server_over_engine", "-"),
                    e.get("median_step_ms", "-"),
                    pair(s, "ttft_ms"),
                    pair(s, "tpot_ms"),
                    pair(s, "itl_ms"),
                    s.get("tokens_per_message"),
                    s.get("goodput_request_s"),
                    s.get("gpu_idle_fraction", "-"),
                    f"{s.get('cached_prompt_tokens')} / {s.get('prompt_tokens')}",
                    sum(s.get("errors", {}).values()) or 0,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def compare_fronts(rows: list[dict]) -> list[dict]:
    """Per level run through both fronts: HTTP's streamed tokens/s over gRPC's, and their latencies."""
    same = ("mode", "concurrency", "request_rate", "api_processes", "transport", "prefix_caching")
    grpc = {tuple(r.get(k) for k in same): r for r in rows if r.get("front", "grpc") == "grpc"}
    out = []
    for r in rows:
        g = grpc.get(tuple(r.get(k) for k in same))
        if r.get("front") != "http" or g is None:
            continue
        h, s = r["server"], g["server"]
        entry = {"level": label(g), "grpc_tok_s": s.get("output_tok_s"), "http_tok_s": h.get("output_tok_s")}
        if entry["grpc_tok_s"] and entry["http_tok_s"]:
            entry["http_over_grpc"] = round(entry["http_tok_s"] / entry["grpc_tok_s"], 3)
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            entry[key] = {"grpc": (s.get(key) or {}).get("p50"), "http": (h.get(key) or {}).get("p50")}
        out.append(entry)
    return out


def front_table(comparison: list[dict]) -> str:
    head = ["level", "gRPC tok/s", "HTTP tok/s", "HTTP / gRPC", "TTFT p50 ms (gRPC / HTTP)",
            "TPOT p50 ms (gRPC / HTTP)", "ITL p50 ms (gRPC / HTTP)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparison:
        pairs = [f"{c[k]['grpc']} / {c[k]['http']}" for k in ("ttft_ms", "tpot_ms", "itl_ms")]
        cells = [c["level"], c["grpc_tok_s"], c["http_tok_s"], c.get("http_over_grpc", "-"), *pairs]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    conc = [r for r in rows if r["mode"] == "concurrency"]
    if not conc:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))

    def key(r: dict) -> tuple[int, str]:
        return r.get("api_processes", 1), r.get("front", "grpc")

    for fronts, api in sorted({key(r) for r in conc}):
        mine = [r for r in conc if key(r) == (fronts, api)]
        x = [r["concurrency"] for r in mine]
        name = f"tandem serve, {'HTTP' if api == 'http' else 'gRPC'}"
        name += "" if fronts == 1 else f", {fronts} fronts"
        left.plot(x, [r["server"].get("output_tok_s") for r in mine], "o-", label=name)
        right.plot(x, [r["server"]["tpot_ms"]["p50"] for r in mine], "o-", label=f"TPOT p50, {name}")
    first = [r for r in conc if key(r) == key(conc[0])]
    if all(r.get("engine") for r in first):
        x = [r["concurrency"] for r in first]
        left.plot(
            x, [r["engine"]["output_tok_s"] for r in first], "s--", color="black", label="engine core alone"
        )
        right.plot(
            x,
            [r["engine"]["tpot_ms"]["p50"] for r in first],
            "s--",
            color="black",
            label="engine alone: TPOT p50",
        )
        right.plot(
            x,
            [r["engine"]["median_step_ms"] for r in first],
            "^:",
            color="gray",
            label="engine alone: median step",
        )
    left.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    right.set(xscale="log", xlabel="concurrent streams", ylabel="ms", title="time per output token")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cached_by_pass(rows: list[dict], engine: list[dict] | None) -> list[dict]:
    """Each pass's prompt tokens and those the prefix cache held (the server's usage; the engine's
    own count for the engine alone, `engine`: its levels' summaries): a pass of prompts of its own
    finds only what its own earlier requests (a shared system prompt) left in the cache."""
    out = [] if engine is None else [{"pass": ENGINE_PASS, "name": "engine alone", **_totals(engine)}]
    by_pass: dict[int, list[dict]] = {}
    for r in rows:
        by_pass.setdefault(r["pass"], []).append(r)
    for number, mine in by_pass.items():
        out.append({"pass": number, "name": mine[0]["pass_name"], **_totals([r["server"] for r in mine])})
    return out


def _totals(summaries: list[dict]) -> dict:
    cached = [s.get("cached_prompt_tokens") for s in summaries]
    return {"prompt_tokens": sum(s.get("prompt_tokens", 0) for s in summaries),
            "cached_prompt_tokens": None if None in cached else sum(cached)}
