"""`tandem bench serve`: load a running `tandem serve` (or one it starts) the way users do, and the
engine core alone with the same model, settings and requests, in the same run.

Fixed-concurrency sweeps (`--concurrency 1,32,256`: that many streams, each sending its requests one
after another) and Poisson request rates (`--request-rate 2,8`); fixed lengths or a ShareGPT-like
mixed-length dataset (`--dataset mixed`); prompts of random token ids, every request running to its
`max_tokens`. Streamed requests come from several client processes (`--clients`), so the client is
never the limit: gRPC `GenerateStream` calls, or OpenAI `/v1/completions` streams over HTTP
(`--front http`), or both, level by level against the same server (`--front both`). Per level:
output tokens/s, TTFT, TPOT and inter-token latency p50/p90/p99, goodput under a TTFT/TPOT SLO, the
server's own GPU idle fraction (scraped from /metrics while the level runs) and, the headline, the
server's tokens/s over the engine alone's (and, with both fronts, HTTP's over gRPC's).

    tandem bench serve --shape 8b --concurrency 1,32,256          # CUDA: random-init 8B shape
    tandem bench serve --shape 8b --concurrency 1,32,256 --front both
    tandem bench serve --model DIR --dataset mixed --request-rate 4,8
    tandem bench serve --server HOST:PORT --concurrency 64        # a server already running
    tandem bench serve --smoke                                     # tiny model on CPU, in seconds

Settings for both sides: `--set NAME=VALUE` (a server setting, as TANDEM_NAME in both environments).
Writes JSON (`--out`), a markdown table beside it and a PNG of throughput and TPOT per level.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import _repo
from serve_server import (
    add_model_options,
    default_tokenizer,
    free_port,
    make_model,
    model_limits,
    resolve_device,
    settings_env,
    settings_of,
    start_server,
    stop_server,
    tls_env,
)
from serve_stats import percentile, summarize
from serve_workload import Job, describe, jobs, poisson_arrivals

from tandem.health import wait_serving

# -- the server ----------------------------------------------------------------------------------


class GaugeSampler:
    """Polls the server's /metrics while levels run: its idle fraction and how many requests run."""

    GAUGES = (
        "tandem_gpu_idle_fraction",
        "tandem_requests_running",
        "tandem_requests_waiting",
        "tandem_capacity_tokens_per_second",
        "tandem_capacity_utilization",
    )

    def __init__(self, url: str | None, period: float = 0.25) -> None:
        self.url, self.period = url, period
        self.samples: list[tuple[float, str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self._stop.wait(self.period):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            now = time.time()
            for family in text_string_to_metric_families(text):
                if family.name in self.GAUGES and family.samples:
                    self.samples.append((now, family.name, family.samples[0].value))

    def __enter__(self) -> GaugeSampler:
        if self.url:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def during(self, name: str, start: float, end: float) -> float | None:
        """The median reading in the middle half of [start, end] (the window has filled by then)."""
        lo, hi = start + (end - start) / 4, end - (end - start) / 4
        median = percentile([v for t, n, v in self.samples if n == name and lo <= t <= hi], 50)
        return None if median is None else round(median, 4)


# -- the levels ----------------------------------------------------------------------------------


def level_jobs(a: argparse.Namespace, vocab: int, max_model_len: int) -> list[dict]:
    """Each level's requests: the same for the server and the engine alone."""
    levels = []
    for c in a.concurrency:
        count = c * a.requests_per_stream
        levels.append(
            {
                "mode": "concurrency",
                "concurrency": c,
                "jobs": jobs(
                    a.dataset, count, vocab, max_model_len, a.seed + c, a.prompt, a.new, a.shared_prefix
                ),
            }
        )
    for rate in a.request_rate:
        js = jobs(a.dataset, a.num_prompts, vocab, max_model_len, a.seed, a.prompt, a.new, a.shared_prefix)
        levels.append(
            {"mode": "request_rate", "request_rate": rate, "jobs": poisson_arrivals(js, rate, a.seed)}
        )
    for level in levels:
        level["jobs"] = [vars(j) for j in level["jobs"]]
    return levels


def warmup_level(a: argparse.Namespace, vocab: int, max_model_len: int) -> dict | None:
    """One request per stream at the largest concurrency, run untimed by both sides first: what a
    process compiles or tunes on first use (kernels for new shapes) is not in any level."""
    if not a.warmup:
        return None
    c = max(a.concurrency or [32])
    js = jobs(a.dataset, c, vocab, max_model_len, a.seed + 10**6, a.prompt, a.new, a.shared_prefix)
    return {"mode": "concurrency", "concurrency": c, "jobs": [vars(j) for j in js]}


def run_clients(
    address: str, level: dict, clients: int, channels: int, tls_ca: str | None = None, front: str = "grpc"
) -> tuple[list[dict], float, float]:
    """One level through `clients` processes; (requests as timed, start, end) in wall clock.
    `front`: grpc (`address` HOST:PORT) or http (`address` the base URL)."""
    if front == "http":
        from serve_http_client import run_http_client as run_client
    else:
        from serve_client import run_client

    ctx = multiprocessing.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    shares: list[tuple[list, list]] = [([], []) for _ in range(clients)]
    if level["mode"] == "concurrency":
        c = level["concurrency"]
        streams = [level["jobs"][i::c] for i in range(c)]
        for i, stream in enumerate(streams):
            shares[i % clients][0].append(stream)
    else:
        for i, job in enumerate(level["jobs"]):
            shares[i % clients][1].append(job)
    procs = [
        ctx.Process(target=run_client, args=(address, s, r, go, channels, out, tls_ca))
        for s, r in shares
        if s or r
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=120) == "ready"
    start = time.time()
    go.set()
    results = [r for _ in procs for r in out.get(timeout=3600)]
    end = time.time()
    for p in procs:
        p.join()
    return results, start, end


def engine_only(levels: list[dict], warmup: dict | None, env: dict[str, str], folder: Path) -> list[dict]:
    spec, out = folder / "engine_spec.json", folder / "engine_out.json"
    spec.write_text(json.dumps({"levels": levels, "warmup": warmup}))
    here = Path(__file__).resolve().parent
    path = os.pathsep.join(
        p for p in (str(here), env.get("PYTHONPATH", "")) if p
    )  # PYTHONSAFEPATH: no script dir
    subprocess.run(
        [sys.executable, str(here / "serve_engine.py"), str(spec), str(out)],
        env={**env, "PYTHONPATH": path},
        check=True,
    )
    return json.loads(out.read_text())


FRONTS = {"grpc": ["grpc"], "http": ["http"], "both": ["grpc", "http"]}


def fronts_started(log: Path) -> int | None:
    """How many front processes the server whose log this is started (None: no log, no such line)."""
    try:
        found = re.search(r"front process\(es\) ([\d, ]+) on port", log.read_text())
    except OSError:
        return None
    return len(found.group(1).split(", ")) if found else None


def serve_levels(
    a: argparse.Namespace,
    levels: list[dict],
    warmup: dict | None,
    engine_results: list[dict] | None,
    env: dict[str, str],
    log: Path,
    tls_ca: str | None = None,
) -> tuple[list[dict], int | str | None]:
    """Every level through one server (started here unless --server); (rows, the server's exit code).
    `tls_ca`: the server speaks TLS (env has its files) and clients trust this CA. With both fronts
    each level runs through gRPC, then through HTTP, before the next level."""
    proc = None
    fronts = FRONTS[a.front]
    if a.server:
        address, metrics_url, http_url = a.server, a.metrics, a.http_server
    else:
        http_port = free_port() if "http" in fronts else 0
        env = {**env, "TANDEM_HTTP_PORT": str(http_port)}
        proc, address, metrics_url = start_server(env, log)
        http_url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{http_port}"
    targets = {"grpc": address, "http": http_url}
    health = f"127.0.0.1:{env['TANDEM_HEALTH_PORT']}" if "TANDEM_HEALTH_PORT" in env else address
    rows = []
    try:
        wait_serving(health, 1800, lambda: proc is None or proc.poll() is None)
        how = "TLS" if tls_ca else "plaintext"
        processes = env.get("TANDEM_API_PROCESSES", "auto")
        where = ", ".join(f"{f} at {targets[f]}" for f in fronts)
        print(f"server SERVING: {where} ({processes} front process(es), {how})", flush=True)
        if warmup is not None:
            for front in fronts:
                run_clients(targets[front], warmup, a.clients, a.channels, tls_ca, front)
        runs = [(i, level, front) for i, level in enumerate(levels) for front in fronts]
        with GaugeSampler(metrics_url) as gauges:
            for i, level, front in runs:
                target = targets[front]
                requests, start, end = run_clients(target, level, a.clients, a.channels, tls_ca, front)
                row = {k: level[k] for k in ("mode", "concurrency", "request_rate") if k in level}
                row["front"] = front
                row["server"] = summarize(requests, a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3)
                for gauge in GaugeSampler.GAUGES:
                    row["server"][gauge.removeprefix("tandem_")] = gauges.during(gauge, start, end)
                if engine_results is not None:
                    e = engine_results[i]
                    row["engine"] = {
                        **summarize(e["requests"], a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3),
                        "median_step_ms": e["median_step_ms"],
                        "engine_idle": e["engine_idle"],
                        "roofline_step_ms": e.get("roofline_step_ms"),
                        "copy_bandwidth_TBps": e.get("copy_bandwidth_TBps"),
                    }
                    roof = e.get("roofline_step_ms")
                    if roof and row["server"].get("tpot_ms"):
                        row["server"]["tpot_p50_over_roofline_step"] = round(
                            row["server"]["tpot_ms"]["p50"] / roof, 3
                        )
                    if row["server"].get("tpot_ms") and e["median_step_ms"]:
                        row["server"]["tpot_p50_over_engine_median_step"] = round(
                            row["server"]["tpot_ms"]["p50"] / e["median_step_ms"], 3
                        )
                    row["server_over_engine"] = round(
                        row["server"]["output_tok_s"] / row["engine"]["output_tok_s"], 3
                    )
                ratio = f" ({row['server_over_engine']:.0%} of the engine alone)" if "engine" in row else ""
                print(f"{_label(row)}: server {row['server'].get('output_tok_s')} tok/s{ratio}", flush=True)
                rows.append(row)
    finally:
        code = None if proc is None else stop_server(proc)
    return rows, code


# -- output --------------------------------------------------------------------------------------


def _label(level: dict) -> str:
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
                    _label(r),
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
        entry = {"level": _label(g), "grpc_tok_s": s.get("output_tok_s"), "http_tok_s": h.get("output_tok_s")}
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


# -- main ----------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = add_model_options(ap)  # --shape, --model, --tokenizer, --device, --set
    where.add_argument("--server", help="HOST:PORT of a running server: no engine-only figure")
    ap.add_argument("--metrics", help="with --server: its /metrics URL, for the idle fraction")
    ap.add_argument(
        "--front",
        choices=sorted(FRONTS),
        default="grpc",
        help="which API the clients stream from: grpc (GenerateStream), http (the OpenAI "
        "/v1/completions, SSE), or both, level by level on the same server",
    )
    ap.add_argument("--http-server", help="with --server and an HTTP front: its base URL, http://HOST:PORT")
    ap.add_argument("--concurrency", type=_ints, default=[], help="fixed-concurrency levels, e.g. 1,32,256")
    ap.add_argument("--request-rate", type=_floats, default=[], help="Poisson request rates per second")
    ap.add_argument("--dataset", choices=["fixed", "mixed"], default="fixed")
    ap.add_argument("--prompt", type=int, default=128, help="fixed: prompt tokens")
    ap.add_argument("--new", type=int, default=256, help="fixed: new tokens per request")
    ap.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens every prompt starts with (a system prompt)"
    )
    ap.add_argument(
        "--prefix-caching",
        choices=["on", "off", "both"],
        default=None,
        help="the server's prefix caching (default: its setting); both: one server each, same levels",
    )
    ap.add_argument(
        "--requests-per-stream", type=int, default=4, help="concurrency levels: requests per stream"
    )
    ap.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed first pass (one request per stream at the largest concurrency)",
    )
    ap.add_argument("--num-prompts", type=int, default=200, help="request-rate levels: requests per level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=min(8, os.cpu_count() or 1), help="client processes")
    ap.add_argument("--channels", type=int, default=4, help="gRPC connections per client process")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument(
        "--api-processes",
        type=_ints,
        default=[],
        help="the server's front processes (default: the server's own, auto); several (1,2,4): one "
        "server each, same levels",
    )
    ap.add_argument(
        "--tls",
        metavar="DIR",
        help="also run every level over TLS (DIR: ca.crt, server.crt, server.key for 127.0.0.1), "
        "one server each, beside plaintext",
    )
    ap.add_argument("--no-engine-only", dest="engine_only", action="store_false")
    ap.add_argument("--workdir", default=None, help="where models and logs go (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/serve_<shape>.json)")
    ap.add_argument("--replot", metavar="JSON", help="only draw the PNG of an earlier run's JSON, beside it")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU, a few requests: checks the logic"
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape, a.model, a.server, a.device = "tiny", None, None, "cpu"
        a.concurrency, a.request_rate = a.concurrency or [1, 4], a.request_rate or [20.0]
        a.prompt, a.new, a.requests_per_stream, a.num_prompts = 16, 8, 1, 8
        a.clients, a.channels = 2, 1
        a.set = ["kv_cache_cpu_gib=0.25", *a.set]  # as the soak's: the 2 GiB default takes seconds to zero
    if not (a.shape or a.model or a.server or a.replot):
        ap.error("say what to serve: --shape, --model or --server")
    if a.server and a.front != "grpc" and not a.http_server:
        ap.error("--front http/both with --server needs --http-server")
    if not (a.concurrency or a.request_rate):
        a.concurrency = [1, 32, 256]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.replot:
        done = json.loads(Path(a.replot).read_text())
        where = done["environment"].get("gpu", done["environment"]["cpu"])
        print(
            plot(
                done["levels"],
                Path(a.replot).with_suffix(".png"),
                f"tandem bench serve: {done['what']} on {where}",
            )
        )
        return 0
    folder = Path(a.workdir or tempfile.mkdtemp(prefix="tandem-bench-serve-"))
    folder.mkdir(parents=True, exist_ok=True)
    device = resolve_device(a.device)
    # --set: for both the server and the engine alone
    env = settings_env(a.set, device, telemetry_window_s="2")
    top = max([*a.concurrency, 1])
    if top > 256 and "TANDEM_MAX_NUM_SEQS" not in env:
        env["TANDEM_MAX_NUM_SEQS"] = str(top)

    model_dir = None
    if a.shape:
        model_dir = make_model(
            a.shape, Path(a.tokenizer) if a.tokenizer else default_tokenizer(), folder, device
        )
    elif a.model:
        model_dir = Path(a.model)
    if model_dir is not None:
        env["TANDEM_MODEL"] = str(model_dir)
    vocab, max_model_len = model_limits(model_dir, a.server)
    levels = level_jobs(a, vocab, max_model_len)
    warmup = warmup_level(a, vocab, max_model_len)

    engine_results = None
    if a.engine_only and model_dir is not None:
        print(f"engine alone: {len(levels)} levels", flush=True)
        engine_results = engine_only(levels, warmup, env, folder)

    rows, exit_codes = [], []
    for fronts in a.api_processes or [None]:
        for transport in ["plaintext", "tls"] if a.tls else ["plaintext"]:
            server_env = env if fronts is None else {**env, "TANDEM_API_PROCESSES": str(fronts)}
            tls_ca = None
            if transport == "tls":
                folder_tls = Path(a.tls).resolve()  # the server runs from /
                server_env, tls_ca = {**server_env, **tls_env(folder_tls)}, str(folder_tls / "ca.crt")
            for caching in {"both": ["on", "off"], None: [None]}.get(a.prefix_caching, [a.prefix_caching]):
                tags = {"api_processes": fronts or 1, "transport": transport}
                env_c = server_env
                if caching is not None:
                    env_c = {**server_env, "TANDEM_PREFIX_CACHING": str(caching == "on").lower()}
                    tags["prefix_caching"] = caching == "on"
                log = folder / f"server-{fronts or 'auto'}-{transport}-{caching or 'default'}.log"
                got, code = serve_levels(a, levels, warmup, engine_results, env_c, log, tls_ca)
                if fronts is None:  # the server's default, auto: as many as it started
                    tags["api_processes"] = fronts_started(log) or 1
                rows += [{**row, **tags} for row in got]
                exit_codes.append(code)
    exit_code = next((c for c in exit_codes if c not in (0, None)), exit_codes[-1])

    import torch
    from common import environment  # torch's and the machine's versions

    result = {
        "benchmark": "serve",
        "what": a.shape or a.model or a.server,
        "environment": environment(torch.device(device)),
        "settings": settings_of(env),
        "workload": {
            "dataset": a.dataset,
            "prompt": a.prompt,
            "new": a.new,
            "shared_prefix": a.shared_prefix,
            "seed": a.seed,
            "requests_per_stream": a.requests_per_stream,
            "clients": a.clients,
            "channels": a.channels,
            "levels": [
                {**{k: v for k, v in lv.items() if k != "jobs"}, **describe_jobs(lv)} for lv in levels
            ],
        },
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms},
        "warmup": None
        if warmup is None
        else {"concurrency": warmup["concurrency"], "requests": len(warmup["jobs"])},
        "levels": rows,
        "http_over_grpc": compare_fronts(rows),
        "server_exit_code": exit_code,
    }
    out = (
        Path(a.out)
        if a.out
        else (
            Path(tempfile.gettempdir()) / "serve_smoke.json"
            if a.smoke
            else _repo.REPO / f"bench/results/serve_{a.shape or 'model'}.json"
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = table(rows)
    if result["http_over_grpc"]:
        md += "\n\n" + front_table(result["http_over_grpc"])
    out.with_suffix(".md").write_text(md + "\n")
    png = plot(
        rows,
        out.with_suffix(".png"),
        f"tandem bench serve: {result['what']} on "
        f"{result['environment'].get('gpu', result['environment']['cpu'])}",
    )
    print(md)
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0 if exit_code in (0, None) else 1


def describe_jobs(level: dict) -> dict:
    return describe([Job(**j) for j in level["jobs"]])


if __name__ == "__main__":
    sys.exit(main())
