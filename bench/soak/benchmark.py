"""`tandem bench soak`: does `tandem serve` stay correct and healthy under long, messy load?

It starts its own server and drives it from several client processes: `--requests` (10,000) at
`--concurrency` (256) streams, a mix of the native API (Generate, GenerateStream) and KServe v2
(ModelInfer, ModelStreamInfer), text prompts of varied lengths, varied max_tokens, greedy and sampled,
10% cancelled at random by the client (mid-stream, a short deadline, KServe's `timeout`), all from a
seeded plan (`--seed`). A prober process of its own asks grpc.health.v1 Check every 50 ms meanwhile.

Reported (JSON and a markdown table, bench/results/<date>_<gpu>_soak_<label>.json/.md): status counts per API
kind and the unexpected ones; lost or duplicated tokens (every finished native answer carries as
many token ids as its usage.completion_tokens says; probes, a few prompts repeated on every kind, get
identical answers); KV blocks still in use once the server is idle (GetLoad); the RSS of the
server's processes after an untimed warm-up pass and at the end; health latency; throughput.
The exit status is 1 when a correctness target fails (unexpected statuses, tokens, blocks).

    tandem bench soak --shape tiny --device cpu --sampled-fraction 0   # tiny Llama, real tokenizer
    tandem bench soak --shape 8b --tokenizer DIR --workdir /tmp/soak-8b   # CUDA: the 8B shape
    tandem bench soak --model DIR --server-args='--api-processes 2'
    tandem bench soak --smoke                                 # 300 requests on CPU, in 30 s
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import queue
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.record import ResultFile, machine, versions
from tandem.bench.serve.client import run_client
from tandem.bench.serve.server import (
    VOCAB,
    add_model_options,
    default_tokenizer,
    make_model,
    precision_sets,
    resolve_device,
    settings_env,
    settings_of,
    start_server,
    stop_server,
    tokenizer_size,
)
from tandem.bench.soak import report, watch
from tandem.bench.soak.big_prompts import big_prompt_phase
from tandem.bench.soak.workload import SMOKE_MIX, Mix, as_dicts, calls, describe, plan
from tandem.health import wait_serving

PROGRESS_EVERY_S = 15.0
T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {text}", flush=True)


def run_pass(address: str, requests: list[dict], a: argparse.Namespace) -> dict:
    """Every request through `a.clients` processes, `a.concurrency` streams in all, each stream making
    its calls one after another. A pass that makes no progress for `a.stall_s` is a hang: its
    clients are stopped and what never came back is counted missing."""
    # the client's KServe protos load only here: tritonclient's clash with them in one process
    from tandem.bench.soak import client

    ctx = multiprocessing.get_context("spawn")
    out, go, done = ctx.Queue(), ctx.Event(), ctx.Value("i", 0)
    units = calls(requests)
    streams = [units[i :: a.concurrency] for i in range(min(a.concurrency, len(units)))]
    shares = [streams[i :: a.clients] for i in range(min(a.clients, len(streams)))]
    connect = functools.partial(client.connect, address, a.channels, done)
    procs = [ctx.Process(target=run_client, args=(connect, s, [], go, out)) for s in shares]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=300) == "ready"
    start = time.time()
    go.set()
    outcomes, got, stalled = [], 0, None
    last_done, last_change, last_print = 0, time.monotonic(), time.monotonic()
    while got < len(procs):
        try:
            outcomes += out.get(timeout=1.0)
            got += 1
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        if done.value != last_done:
            last_done, last_change = done.value, now
        if now - last_print > PROGRESS_EVERY_S:
            say(f"{done.value}/{len(requests)} requests")
            last_print = now
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if now - last_change > a.stall_s or dead:
            stalled = {
                "why": f"client exited {dead[0].exitcode}"
                if dead
                else f"no request ended in {a.stall_s:.0f} s",
                "requests_done": done.value,
            }
            say(f"STALLED: {stalled}")
            break
    end = time.time()
    for p in procs:
        if stalled and p.is_alive():
            p.terminate()
        p.join(timeout=30)
    return {"outcomes": outcomes, "start": start, "end": end, "stalled": stalled}


def served_model(address: str) -> str:
    import grpc

    from tandem.v1 import tandem_pb2 as pb
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TandemStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=30).model


def serve_and_soak(a: argparse.Namespace, env: dict[str, str], folder: Path) -> dict:
    warm = as_dicts(plan(a.warmup_requests, a.mix, a.seed + 1, start=a.requests))
    run = as_dicts(plan(a.requests, a.mix, a.seed))
    proc, address, metrics_url = start_server(env, folder / "server.log", a.server_args)
    try:
        wait_serving(address, 1800, lambda: proc.poll() is None)
        say(f"server at {address} SERVING (pid {proc.pid})")
        model = served_model(address)
        for r in warm + run:
            r["model"] = model  # KServe names the model in every request
        warmup = run_pass(address, warm, a) if warm else None
        idle_before = watch.wait_idle(address)
        roles = watch.server_roles(folder / "server.log", proc.pid)
        rss_warm = watch.tree_rss(proc.pid, roles)
        tokens_before = watch.metric(metrics_url, "tandem_generation_tokens_total")
        say(f"warm-up: {len(warm)} requests done; server RSS {rss_warm['total_mib']} MiB")
        with (
            watch.Prober(address, a.health_interval_ms / 1e3) as prober,
            watch.RssSampler(proc.pid, roles) as rss,
        ):
            timed = run_pass(address, run, a)
        say(f"run: {len(run)} requests done")
        blocks = watch.wait_idle(address)
        rss_end = watch.tree_rss(proc.pid, roles)
        time.sleep(1.0)  # the supervisor's counters follow the engine's reports
        tokens_after = watch.metric(metrics_url, "tandem_generation_tokens_total")
        big = None
        if a.big_prompts:
            say(f"big prompts: {a.big_prompts} senders for {a.big_prompt_seconds:.0f} s")
            with watch.Prober(address, a.health_interval_ms / 1e3) as big_prober:
                big = big_prompt_phase(address, a.big_prompts, a.big_prompt_seconds)
            big["health"] = big_prober.summary(a.health_interval_ms / 1e3)
            big["rss_after"] = watch.tree_rss(proc.pid, roles)
    finally:
        code = stop_server(proc)
    seconds = timed["end"] - timed["start"]
    generated = None if None in (tokens_before, tokens_after) else int(tokens_after - tokens_before)
    checked = report.check(run, timed["outcomes"])
    checked["stalled"] = timed["stalled"]
    return {
        "warmup": None
        if warmup is None
        else {
            **{k: v for k, v in report.check(warm, warmup["outcomes"]).items() if k != "tokens"},
            "seconds": round(warmup["end"] - warmup["start"], 1),
            "kv_blocks_after": idle_before,
        },
        "run": checked,
        "kv_blocks": blocks,
        "rss": watch.rss_report(rss_warm, rss_end, rss.samples),
        "health": prober.summary(a.health_interval_ms / 1e3),
        "throughput": {
            "seconds": round(seconds, 2),
            "requests_s": round(len(timed["outcomes"]) / seconds, 2),
            "generated_tokens": generated,
            "tokens_s": None if generated is None else round(generated / seconds, 1),
            "native_tokens_received": sum(o["tokens"] or 0 for o in timed["outcomes"]),
        },
        "big_prompts": big,
        "server_exit_code": code,
        "server_log_problems": watch.log_problems(folder / "server.log"),
    }


def environment(device: str) -> dict:
    """The machine, the checkout and the versions; without importing torch on CPU (seconds on 2 cores)."""
    env = {**machine(), **versions("torch", "transformers", "grpcio"), "device": device}
    if device == "cuda":
        import torch

        env["gpu"] = torch.cuda.get_device_name()
    return env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)  # --shape, --model, --tokenizer, --device, --set; neither: the embedded model
    ap.add_argument(
        "--server-args", default="", help="more `tandem serve` arguments, one string: --server-args='--a 1'"
    )
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=256, help="streams at once, over all clients")
    ap.add_argument("--clients", type=int, default=min(8, os.cpu_count() or 1), help="client processes")
    ap.add_argument("--channels", type=int, default=4, help="gRPC connections per client process")
    ap.add_argument("--warmup-requests", type=int, default=None, help="untimed pass first (2 x concurrency)")
    ap.add_argument("--cancel-fraction", type=float, default=0.10, help="requests the soak cancels")
    ap.add_argument(
        "--sampled-fraction",
        type=float,
        default=0.5,
        help="requests with temperature > 0, the rest greedy; 0: no sampling at all, probes included",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--big-prompts",
        type=int,
        default=8,
        help="after the run: this many senders of 4 MB to 64 KB prompts at once, health probed (0 = off)",
    )
    ap.add_argument("--big-prompt-seconds", type=float, default=20.0)
    ap.add_argument("--health-interval-ms", type=float, default=50.0)
    ap.add_argument("--stall-s", type=float, default=300.0, help="no request ending this long is a hang")
    ap.add_argument(
        "--strict-probes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="probe answers that differ fail the run (default: on CPU only; see soak/report.targets)",
    )
    ap.add_argument("--label", default=None,
                    help="names the results: <date>_<gpu>_soak_<label>.json (default: the shape)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_<gpu>_soak_<label>.json)")
    ap.add_argument("--workdir", default=None, help="where models and logs go (default: a temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, 300 short requests: in seconds")
    a = ap.parse_args(argv)
    a.mix = Mix()
    if a.smoke:
        a.shape, a.device = (None if a.model else "tiny"), "cpu"  # --model: a tiny model of one's own
        a.requests, a.concurrency, a.clients, a.channels = 300, 32, 2, 1
        a.warmup_requests = 32 if a.warmup_requests is None else a.warmup_requests
        a.mix = SMOKE_MIX
        a.big_prompts, a.big_prompt_seconds = min(a.big_prompts, 2), 3.0
        a.set = ["kv_cache_cpu_gib=0.25", *a.set]  # the 2 GiB default takes seconds to zero
    a.mix = Mix(
        **{**vars(a.mix), "cancel_fraction": a.cancel_fraction, "sampled_fraction": a.sampled_fraction}
    )
    if a.warmup_requests is None:
        a.warmup_requests = min(a.requests, 2 * a.concurrency)
    a.server_args = shlex.split(a.server_args)
    a.label = a.label or ("smoke" if a.smoke else a.shape or ("model" if a.model else "embedded"))
    return a


def model_env(a: argparse.Namespace, env: dict[str, str], folder: Path, device: str) -> None:
    """TANDEM_MODEL: a random-initialised shape made here (its vocabulary the tokenizer's, for text
    prompts), --model, or neither (the embedded model)."""
    if a.shape:
        tokenizer = Path(a.tokenizer) if a.tokenizer else default_tokenizer()
        vocab = max(VOCAB[a.shape], tokenizer_size(tokenizer))
        env["TANDEM_MODEL"] = str(make_model(a.shape, tokenizer, folder, device, vocab))
    elif a.model:
        env["TANDEM_MODEL"] = a.model


def judged(a: argparse.Namespace, env: dict[str, str], device: str, result: dict, folder: Path) -> dict:
    """The soak's record: what ran, what came back, and the targets met or missed."""
    record = {
        "benchmark": "soak",
        "label": a.label,
        "what": a.shape or a.model or "embedded default model",
        "environment": environment(device),
        "settings": settings_of(env),
        "server_args": a.server_args,
        "workload": {
            "requests": a.requests,
            "concurrency": a.concurrency,
            "clients": a.clients,
            "channels": a.channels,
            "seed": a.seed,
            "warmup_requests": a.warmup_requests,
            "mix": json.loads(json.dumps(vars(a.mix), default=vars)),
            "plan": describe(plan(a.requests, a.mix, a.seed)),
        },
        **result,
        "server_log": str(folder / "server.log"),
    }
    record["strict_probes"] = a.strict_probes if a.strict_probes is not None else device == "cpu"
    record["targets"] = report.targets(record, record["strict_probes"])
    failed = [n for n, t in record["targets"].items() if t["correctness"] and not t["met"]]
    crashed = record["server_exit_code"] not in (0, None) or record["run"]["stalled"]
    record["passed"] = not failed and not crashed
    record["failed"] = failed
    return record


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    # a SIGTERM ends the soak through its `finally`s, so that the server it started stops too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder = Path(a.workdir or tempfile.mkdtemp(prefix="tandem-bench-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    device = resolve_device(a.device)
    result_file = ResultFile("soak", argv, device, a.label, a.out, tempfile.gettempdir() if a.smoke else None)
    env = settings_env([*a.set, *precision_sets(a)], device)
    if a.concurrency > 256 and "TANDEM_MAX_NUM_SEQS" not in env:
        env["TANDEM_MAX_NUM_SEQS"] = str(a.concurrency)
    model_env(a, env, folder, device)
    say(
        f"soak: {a.requests} requests at {a.concurrency} streams from {a.clients} clients, "
        f"serving {a.shape or a.model or 'the embedded model'} on {device}"
    )
    record = judged(a, env, device, serve_and_soak(a, env, folder), folder)
    out = result_file.write(record, report.markdown)
    print(out.with_suffix(".md").read_text(), end="")
    why = record["failed"] or "the server or a pass"
    print(f"wrote {out}" + ("" if record["passed"] else f"; FAILED: {why}"))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
