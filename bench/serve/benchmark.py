"""`tandem bench serve`: load a running `tandem serve` (or one it starts) the way users do, and the
engine core alone with the same model, settings and request lengths, in the same run.

Fixed-concurrency sweeps (`--concurrency 1,32,256`: that many streams, each sending its requests one
after another) and Poisson request rates (`--request-rate 2,8`); fixed lengths or a ShareGPT-like
mixed-length dataset (`--dataset mixed`); prompts of random token ids, every request running to its
`max_tokens`. Streamed requests come from several client processes (`--clients`), so the client is
never the limit: gRPC `GenerateStream` calls, or OpenAI `/v1/completions` streams over HTTP
(`--front http`), or both, level by level against the same server (`--front grpc,http`). Per level:
output tokens/s, TTFT, TPOT and inter-token latency p50/p90/p99, goodput under a TTFT/TPOT SLO, the
server's own GPU idle fraction (scraped from /metrics while the level runs), the prompt tokens the
server's prefix cache held and, the headline, the server's tokens/s over the engine alone's (and,
with both fronts, HTTP's over gRPC's).

Passes share nothing warm. A pass is the engine alone, or one front on one server (each front of
`--front`, on each server of `--api-processes`, `--tls` and `--prefix-caching`). Every pass sends
prompts of its own: the same lengths level by level (so the passes do the same work), other token
ids (a salt per pass and level: prompts.py), and with `--shared-prefix` a system prompt of its own;
its untimed warm-up sends its own prompts too. So no pass finds in the prefix cache what another
put there (prefix caching stays on, as deployed): each level records the cached prompt tokens the
server reports (gRPC: the final message's usage.cached_prompt_tokens; HTTP: the usage chunk's
prompt_tokens_details.cached_tokens) and the engine alone its own, and `cached_by_pass` totals
them, so the record shows that each pass's cache hits came from its own prompts (none without a
shared system prompt).

    tandem bench serve --shape 8b --concurrency 1,32,256          # CUDA: random-init 8B shape
    tandem bench serve --shape 8b --concurrency 1,32,256 --front grpc,http
    tandem bench serve --model DIR --dataset mixed --request-rate 4,8
    tandem bench serve --server HOST:PORT --concurrency 64        # a server already running
    tandem bench serve --smoke                                     # tiny model on CPU, in seconds

Settings for both sides: `--set NAME=VALUE` (a server setting, as TANDEM_NAME in both environments).
Writes JSON (`--out`), a markdown table beside it and a PNG of throughput and TPOT per level.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.prompts import Job, describe, jobs, poisson_arrivals, system_prompt
from tandem.bench.record import ResultFile
from tandem.bench.serve.client import Connect, run_clients
from tandem.bench.serve.report import (
    ENGINE_PASS,
    cached_by_pass,
    compare_fronts,
    front_table,
    label,
    plot,
    table,
)
from tandem.bench.serve.server import (
    CpuSplit,
    GaugeSampler,
    add_model_options,
    default_tokenizer,
    free_port,
    make_model,
    model_limits,
    precision_sets,
    resolve_device,
    settings_env,
    settings_of,
    start_server,
    stop_server,
    tls_env,
)
from tandem.bench.serve.stats import summarize
from tandem.health import wait_serving

FRONTS = ("grpc", "http")
FRONT_ALIASES = {"both": "grpc,http"}

# -- the passes ----------------------------------------------------------------------------------


@dataclass
class Pass:
    """The requests of one pass: its levels and its warm-up, prompts of its own."""

    number: int
    name: str
    levels: list[dict]
    warmup: dict | None


def make_pass(a: argparse.Namespace, vocab: int, max_model_len: int, number: int, name: str) -> Pass:
    """Pass `number`'s levels and warm-up: each level's lengths as every pass has them (its seed),
    token ids of this pass and level alone (the salt), after this pass's own system prompt."""
    salt = f"pass{number}"
    prefix = system_prompt(min(a.shared_prefix, max_model_len - 3), vocab, salt)

    def drawn(count: int, seed: int, what: str) -> list[Job]:
        return jobs(a.dataset, count, vocab, max_model_len, seed, a.prompt, a.new, prefix, f"{salt}/{what}")

    levels = [
        {"mode": "concurrency", "concurrency": c,
         "jobs": drawn(c * a.requests_per_stream, a.seed + c, f"level{i}")}
        for i, c in enumerate(a.concurrency)
    ]
    for rate in a.request_rate:
        js = poisson_arrivals(drawn(a.num_prompts, a.seed, f"level{len(levels)}"), rate, a.seed)
        levels.append({"mode": "request_rate", "request_rate": rate, "jobs": js})
    for level in levels:
        level["jobs"] = [vars(j) for j in level["jobs"]]
    return Pass(number, name, levels, warmup_level(a, drawn))


def warmup_level(a: argparse.Namespace, drawn: Callable[[int, int, str], list[Job]]) -> dict | None:
    """One request per stream at the largest concurrency, run untimed by each pass first: what a
    process compiles or tunes on first use (kernels for new shapes) is not in any level."""
    if not a.warmup:
        return None
    c = max(a.concurrency or [32])
    js = drawn(c, a.seed + 10**6, "warmup")
    return {"mode": "concurrency", "concurrency": c, "jobs": [vars(j) for j in js]}


def connect_to(front: str, target: str, channels: int, tls_ca: str | None) -> Connect:
    """The client processes' connection: gRPC (`target` HOST:PORT) or HTTP (`target` the base URL)."""
    if front == "http":
        from tandem.bench.serve import client_http as client
    else:
        from tandem.bench.serve import client_grpc as client
    return functools.partial(client.connect, target, channels, tls_ca)


# -- the engine alone ----------------------------------------------------------------------------


def engine_only(p: Pass, env: dict[str, str], folder: Path, cpus: CpuSplit) -> list[dict]:
    """The pass's levels through the engine core alone, in a process of its own (the server's
    settings from its environment), on the CPUs the server gets."""
    spec, out = folder / "engine_spec.json", folder / "engine_out.json"
    spec.write_text(json.dumps({"levels": p.levels, "warmup": p.warmup}))
    proc = subprocess.Popen([sys.executable, "-m", "tandem.bench.serve.engine_alone", str(spec), str(out)],
                            env=env)
    cpus.pin_measured(proc.pid)
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return json.loads(out.read_text())


def with_engine(row: dict, e: dict, a: argparse.Namespace) -> None:
    """The engine alone's figures of the same level beside the server's, and their ratios."""
    row["engine"] = {
        **summarize(e["requests"], a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3),
        "median_step_ms": e["median_step_ms"],
        "engine_idle": e["engine_idle"],
        "roofline_step_ms": e.get("roofline_step_ms"),
        "copy_bandwidth_TBps": e.get("copy_bandwidth_TBps"),
    }
    server, roof = row["server"], e.get("roofline_step_ms")
    if roof and server.get("tpot_ms"):
        server["tpot_p50_over_roofline_step"] = round(server["tpot_ms"]["p50"] / roof, 3)
    if server.get("tpot_ms") and e["median_step_ms"]:
        server["tpot_p50_over_engine_median_step"] = round(server["tpot_ms"]["p50"] / e["median_step_ms"], 3)
    row["server_over_engine"] = round(server["output_tok_s"] / row["engine"]["output_tok_s"], 3)


# -- the server ----------------------------------------------------------------------------------


@dataclass
class Server:
    """One server of the run: its environment, its TLS CA (None: plaintext), the tags of its rows."""

    env: dict[str, str]
    tls_ca: str | None
    tags: dict
    log: Path

    def describe(self) -> str:
        what = f"{self.tags['api_processes']} front process(es), {self.tags['transport']}"
        if "prefix_caching" in self.tags:
            what += f", prefix caching {'on' if self.tags['prefix_caching'] else 'off'}"
        return what


def fronts_started(log: Path) -> int | None:
    """How many front processes the server whose log this is started (None: no log, no such line)."""
    try:
        found = re.search(r"front process\(es\) ([\d, ]+) on port", log.read_text())
    except OSError:
        return None
    return len(found.group(1).split(", ")) if found else None


def servers(a: argparse.Namespace, env: dict[str, str], folder: Path) -> list[Server]:
    """A server per front-process count, transport and prefix-caching setting asked for."""
    out = []
    for fronts in a.api_processes or [None]:
        for transport in ["plaintext", "tls"] if a.tls else ["plaintext"]:
            server_env = env if fronts is None else {**env, "TANDEM_API_PROCESSES": str(fronts)}
            tls_ca = None
            if transport == "tls":
                folder_tls = Path(a.tls).resolve()  # the server runs from /
                server_env, tls_ca = {**server_env, **tls_env(folder_tls)}, str(folder_tls / "ca.crt")
            for caching in {"both": ["on", "off"], None: [None]}.get(a.prefix_caching, [a.prefix_caching]):
                tags = {"api_processes": fronts or "auto", "transport": transport}
                env_c = server_env
                if caching is not None:
                    env_c = {**server_env, "TANDEM_PREFIX_CACHING": str(caching == "on").lower()}
                    tags["prefix_caching"] = caching == "on"
                log = folder / f"server-{fronts or 'auto'}-{transport}-{caching or 'default'}.log"
                out.append(Server(env_c, tls_ca, tags, log))
    return out


def serve_levels(
    a: argparse.Namespace, passes: dict[str, Pass], engine_results: list[dict] | None, server: Server
) -> tuple[list[dict], int | str | None]:
    """Every level through one server (started here unless --server), each front its own pass;
    (rows, the server's exit code). With both fronts each level runs through gRPC, then through
    HTTP, before the next level."""
    proc, env, tls_ca = None, server.env, server.tls_ca
    if a.server:
        address, metrics_url, http_url = a.server, a.metrics, a.http_server
    else:
        http_port = free_port() if "http" in passes else 0
        env = {**env, "TANDEM_HTTP_PORT": str(http_port)}
        proc, address, metrics_url = start_server(env, server.log, cpus=a.cpus)
        http_url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{http_port}"
    connects = {f: connect_to(f, {"grpc": address, "http": http_url}[f], a.channels, tls_ca) for f in passes}
    health = f"127.0.0.1:{env['TANDEM_HEALTH_PORT']}" if "TANDEM_HEALTH_PORT" in env else address
    rows = []
    try:
        wait_serving(health, 1800, lambda: proc is None or proc.poll() is None)
        if server.tags["api_processes"] == "auto":  # the server's default: as many as it started
            server.tags["api_processes"] = fronts_started(server.log) or 1
        where = ", ".join(f"{f} at {address if f == 'grpc' else http_url}" for f in passes)
        print(f"server SERVING: {where} ({server.describe()})", flush=True)
        for front, p in passes.items():
            if p.warmup is not None:
                run_clients(connects[front], p.warmup, a.clients, a.cpus.pin_client)
        n_levels = len(next(iter(passes.values())).levels)
        with GaugeSampler(metrics_url) as gauges:
            for i in range(n_levels):
                for front, p in passes.items():
                    level = p.levels[i]
                    requests, start, end = run_clients(connects[front], level, a.clients, a.cpus.pin_client)
                    got = summarize(requests, a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3)
                    row = level_row(p, i, front, got)
                    for gauge in GaugeSampler.GAUGES:
                        row["server"][gauge.removeprefix("tandem_")] = gauges.during(gauge, start, end)
                    if engine_results is not None:
                        with_engine(row, engine_results[i], a)
                    ratio = ""
                    if "engine" in row:
                        ratio = f" ({row['server_over_engine']:.0%} of the engine alone)"
                    print(f"{label(row)}: server {row['server'].get('output_tok_s')} tok/s{ratio}; "
                          f"cached prompt tokens {row['server'].get('cached_prompt_tokens')}", flush=True)
                    rows.append(row)
    finally:
        code = None if proc is None else stop_server(proc)
    return rows, code


def level_row(p: Pass, i: int, front: str, server: dict) -> dict:
    level = p.levels[i]
    row = {k: level[k] for k in ("mode", "concurrency", "request_rate") if k in level}
    return {**row, "front": front, "pass": p.number, "pass_name": p.name, "server": server}


def serve_passes(
    a: argparse.Namespace, env: dict[str, str], folder: Path, engine_results: list[dict] | None, limits: tuple
) -> tuple[list[dict], int | str | None]:
    """Every server in turn, each front a pass of its own: (rows, the first failing exit code)."""
    rows, exit_codes, number = [], [], ENGINE_PASS
    for server in servers(a, env, folder):
        passes = {}
        for front in a.front:
            number += 1
            passes[front] = make_pass(a, *limits, number, f"{front}, {server.describe()}")
        got, code = serve_levels(a, passes, engine_results, server)
        rows += [{**row, **server.tags} for row in got]
        exit_codes.append(code)
    return rows, next((c for c in exit_codes if c not in (0, None)), exit_codes[-1])


# -- the run -------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _fronts(text: str) -> list[str]:
    names = [n for n in FRONT_ALIASES.get(text, text).split(",") if n]
    unknown = [n for n in names if n not in FRONTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {', '.join(FRONTS)} (or both)")
    return list(dict.fromkeys(names))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = add_model_options(ap)  # --shape, --model, --tokenizer, --device, --set
    where.add_argument("--server", help="HOST:PORT of a running server: no engine-only figure")
    ap.add_argument("--metrics", help="with --server: its /metrics URL, for the idle fraction")
    ap.add_argument(
        "--front",
        type=_fronts,
        default=["grpc"],
        help="which APIs the clients stream from, a comma list: grpc (GenerateStream), http (the OpenAI "
        "/v1/completions, SSE); grpc,http (or both): level by level on the same server, each a pass of "
        "its own prompts",
    )
    ap.add_argument("--http-server", help="with --server and an HTTP front: its base URL, http://HOST:PORT")
    ap.add_argument("--concurrency", type=_ints, default=[], help="fixed-concurrency levels, e.g. 1,32,256")
    ap.add_argument("--request-rate", type=_floats, default=[], help="Poisson request rates per second")
    ap.add_argument("--dataset", choices=["fixed", "mixed"], default="fixed")
    ap.add_argument("--prompt", type=int, default=128, help="fixed: prompt tokens")
    ap.add_argument("--new", type=int, default=256, help="fixed: new tokens per request")
    ap.add_argument(
        "--shared-prefix", type=int, default=0,
        help="tokens every prompt of a pass starts with (a system prompt, each pass its own)",
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
        help="skip each pass's untimed first requests (one per stream at the largest concurrency)",
    )
    ap.add_argument("--num-prompts", type=int, default=200, help="request-rate levels: requests per level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=min(8, os.cpu_count() or 1), help="client processes")
    ap.add_argument("--channels", type=int, default=4, help="gRPC connections per client process")
    ap.add_argument(
        "--client-cpus",
        type=int,
        default=0,
        help="run the client processes on the last N CPUs of this host and the server (and the engine "
        "alone) on the rest, so neither takes the other's cycles (default 0: all share every CPU)",
    )
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
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_<gpu>_serve_<shape>-<dataset>-<fronts>"
                    ".json)")
    ap.add_argument("--replot", metavar="JSON", help="only draw the PNG of an earlier run's JSON, beside it")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU, a few requests: checks the logic"
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape, a.model, a.server, a.device = "tiny", None, None, "cpu"
        a.concurrency, a.request_rate = a.concurrency or [1, 4], a.request_rate or [20.0]
        # three cache blocks of 16: a prompt another pass had sent would show as cached
        a.prompt, a.new, a.requests_per_stream, a.num_prompts = 48, 8, 1, 8
        a.clients, a.channels = 2, 1
        a.set = ["kv_cache_cpu_gib=0.25", *a.set]  # as the soak's: the 2 GiB default takes seconds to zero
    if not (a.shape or a.model or a.server or a.replot):
        ap.error("say what to serve: --shape, --model or --server")
    if a.server and "http" in a.front and not a.http_server:
        ap.error("--front http with --server needs --http-server")
    if not (a.concurrency or a.request_rate):
        a.concurrency = [1, 32, 256]
    if a.client_cpus and a.server:
        ap.error("--client-cpus splits this host between the clients and a server the benchmark starts")
    a.cpus = CpuSplit.of(a.client_cpus)
    return a


def replot(path: Path) -> int:
    done = json.loads(path.read_text())
    where = done["environment"].get("gpu", done["environment"]["cpu"])
    print(plot(done["levels"], path.with_suffix(".png"), f"tandem bench serve: {done['what']} on {where}"))
    return 0


def model_to_serve(a: argparse.Namespace, folder: Path, device: str) -> Path | None:
    """The model directory both sides load: a random-initialised shape made here, or --model."""
    if a.shape:
        return make_model(a.shape, Path(a.tokenizer) if a.tokenizer else default_tokenizer(), folder, device)
    return Path(a.model) if a.model else None


def result_shape(a: argparse.Namespace) -> str:
    """`8b-fixed-grpc+http`: what was served, the dataset (and system prompt), the fronts."""
    what = a.shape or ("model" if a.model else "server")
    prefix = f"-prefix{a.shared_prefix}" if a.shared_prefix else ""
    return f"{what}-{a.dataset}{prefix}-{'+'.join(a.front)}"


def record(a: argparse.Namespace, env: dict[str, str], device: str, engine_pass: Pass, rows: list[dict],
           engine_results: list[dict] | None, exit_code: int | str | None) -> dict:
    import torch

    from tandem.bench.engine.harness import environment  # torch's and the machine's versions

    engine = None
    if engine_results is not None:
        engine = [summarize(e["requests"], a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3) for e in engine_results]
    return {
        "benchmark": "serve",
        "what": a.shape or a.model or a.server,
        "environment": environment(torch.device(device)),
        "settings": settings_of(env),
        # what both sides ran (the server's settings unset: none = as the checkpoint is, auto = its dtype)
        "precision": {
            "quantization": env.get("TANDEM_QUANTIZATION") or "none",
            "kv_cache_dtype": env.get("TANDEM_KV_CACHE_DTYPE") or "auto",
        },
        "workload": {
            "dataset": a.dataset,
            "prompt": a.prompt,
            "new": a.new,
            "shared_prefix": a.shared_prefix,
            "seed": a.seed,
            "requests_per_stream": a.requests_per_stream,
            "clients": a.clients,
            "channels": a.channels,
            "cpus": {"clients": list(a.cpus.clients), "measured": list(a.cpus.measured)},
            "fronts": a.front,
            "prompts": "each pass its own: the same lengths level by level, token ids and system prompt "
            "drawn for the pass (nothing of one pass in another's prefix cache)",
            "levels": [
                {**{k: v for k, v in lv.items() if k != "jobs"}, **describe([Job(**j) for j in lv["jobs"]])}
                for lv in engine_pass.levels
            ],
        },
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms},
        "warmup": None
        if engine_pass.warmup is None
        else {"concurrency": engine_pass.warmup["concurrency"], "requests": len(engine_pass.warmup["jobs"])},
        "levels": rows,
        "cached_by_pass": cached_by_pass(rows, engine),
        "http_over_grpc": compare_fronts(rows),
        "server_exit_code": exit_code,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.replot:
        return replot(Path(a.replot))
    folder = Path(a.workdir or tempfile.mkdtemp(prefix="tandem-bench-serve-"))
    folder.mkdir(parents=True, exist_ok=True)
    device = resolve_device(a.device)
    result_file = ResultFile("serve", argv, device, result_shape(a), a.out,
                             tempfile.gettempdir() if a.smoke else None)
    # --set: for both the server and the engine alone
    env = settings_env([*a.set, *precision_sets(a)], device, telemetry_window_s="2")
    top = max([*a.concurrency, 1])
    if top > 256 and "TANDEM_MAX_NUM_SEQS" not in env:
        env["TANDEM_MAX_NUM_SEQS"] = str(top)
    model_dir = model_to_serve(a, folder, device)
    if model_dir is not None:
        env["TANDEM_MODEL"] = str(model_dir)
    limits = model_limits(model_dir, a.server)
    engine_pass = make_pass(a, *limits, ENGINE_PASS, "engine alone")
    engine_results = None
    if a.engine_only and model_dir is not None:
        print(f"engine alone: {len(engine_pass.levels)} levels", flush=True)
        engine_results = engine_only(engine_pass, env, folder, a.cpus)
    rows, exit_code = serve_passes(a, env, folder, engine_results, limits)
    result = record(a, env, device, engine_pass, rows, engine_results, exit_code)
    md = table(rows)
    if result["http_over_grpc"]:
        md += "\n\n" + front_table(result["http_over_grpc"])
    where = result["environment"].get("gpu", result["environment"]["cpu"])
    title = f"tandem bench serve: {result['what']} on {where}"
    out = result_file.write(result, md, lambda png: plot(rows, png, title))
    print(md)
    figure = result_file.figure
    missing = "" if importlib.util.find_spec("matplotlib") else " (needs matplotlib: pip install matplotlib)"
    print(f"wrote {out}" + (f" and {figure}" if figure else f"; no figure{missing}"))
    return 0 if exit_code in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
