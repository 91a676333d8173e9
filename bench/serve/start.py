"""`tandem bench start`: how long `tandem serve` takes to serve, phase by phase, and whether its first
requests are as fast as later ones.

Each start is a fresh `tandem serve` process on the same model and settings, timed from the launch
to SERVING (gRPC health) by the benchmark, and phase by phase by the server itself
(`tandem_startup_seconds{phase}`, `tandem_startup_serving_seconds`: docs/telemetry.md):

- `cold`: an empty compile cache (a cache directory of its own: nothing compiled before);
- `warm`: a new server on the cache `cold` filled (a new pod of a scale-up on a shared volume);
- `restart`: the same again (a restart on the same node: the weights in the page cache as well).

The first start reads the weights from disk as they are; every start reads them through the OS's
page cache as it is (the benchmark neither drops nor warms it: the first start's `weights` phase
is the one closest to a new node), unless `--evict-weights` drops the model's weight files from the
page cache before each start (a node that never read the model). After SERVING, each start sends
`--requests` requests one after another (a short prompt of its own, a few tokens each) and reports
the TTFT of the first half against the second: the first requests after SERVING should pay for
nothing lazy.

    tandem bench start --shape 8b                  # CUDA: random-init 8B shape, cold / warm / restart
    tandem bench start --model DIR --runs warm,restart --cache-dir /mnt/shared
    tandem bench start --smoke                     # the embedded model on the CPU, in a minute
    tandem bench start --smoke --runs warm,restart --evict-weights --set prefetch_weights=false
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.record import ResultFile
from tandem.bench.serve.server import (
    add_model_options,
    default_tokenizer,
    make_model,
    resolve_device,
    settings_env,
    start_server,
    stop_server,
)
from tandem.health import wait_serving
from tandem.service.models.prefetch import weight_files

RUNS = ("cold", "warm", "restart")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench start", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}, in order")
    ap.add_argument("--cache-dir", help="the servers' cache directory (default: a new temporary one; "
                                        "`cold` empties its compiled artefacts first)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests after SERVING, one after another (default 64; 16 with --smoke)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="longest wait for SERVING")
    ap.add_argument("--smoke", action="store_true", help="the embedded model on the CPU, 16 requests")
    ap.add_argument("--out", help="JSON path (default: bench/results/ under the standard name)")
    ap.add_argument("--evict-weights", action="store_true",
                    help="drop the model's weight files from the page cache before each start (a new node)")
    ap.add_argument("--logs", default=None, metavar="DIR",
                    help="keep each start's server log in DIR (server-<run>.log: the start-up's parts)")
    a = ap.parse_args(argv)
    a.run_list = a.runs.split(",")
    unknown = set(a.run_list) - set(RUNS)
    if unknown:
        ap.error(f"unknown runs {sorted(unknown)}: expected some of {list(RUNS)}")
    if a.smoke:
        a.device = "cpu"
    a.requests = a.requests or (16 if a.smoke else 64)
    return a


async def _first_requests(address: str, count: int, salt: int) -> list[float]:
    """TTFT in seconds of `count` short requests sent one after another."""
    from tandem.bench.serve.client_grpc import connect

    ttfts = []
    async with connect(address, 1) as send:
        for i in range(count):
            prompt = [100 + (salt * 7919 + i * 31 + j) % 20000 for j in range(16)]  # each start's own
            job = {"prompt_ids": prompt, "max_tokens": 4}
            (timed,) = await send(0, job)
            if timed.error or timed.first is None:
                raise RuntimeError(f"request {i} after SERVING failed: {timed.error}")
            ttfts.append(timed.first - timed.start)
    return ttfts


def _scrape_startup(metrics_url: str) -> tuple[dict[str, float], float | None]:
    """The server's own account: (seconds per start-up phase, seconds to SERVING or None yet)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        samples = [s for family in text_string_to_metric_families(r.read().decode()) for s in family.samples]
    phases = {s.labels["phase"]: s.value for s in samples if s.name == "tandem_startup_seconds"}
    serving = [s.value for s in samples if s.name == "tandem_startup_serving_seconds"]
    return phases, serving[0] if serving else None


def evict(files: list[Path]) -> None:
    """Drop `files` from the page cache (posix_fadvise DONTNEED, after their dirty pages are
    written): the next read comes from the disk, as on a node that never read them."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_start(a: argparse.Namespace, run: str, env: dict[str, str], folder: Path, index: int) -> dict:
    log = folder / f"server-{run}.log"
    launched = time.time()
    proc, address, metrics_url = start_server(env, log)
    try:
        wait_serving(address, a.timeout_s, lambda: proc.poll() is None)
        serving_s = time.time() - launched
        deadline = time.monotonic() + 10  # the supervisor records SERVING as the fronts turn to it
        phases, server_serving = _scrape_startup(metrics_url)
        while server_serving is None and time.monotonic() < deadline:
            time.sleep(0.1)
            phases, server_serving = _scrape_startup(metrics_url)
        ttfts = asyncio.run(_first_requests(address, a.requests, index))
    except Exception:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        stop_server(proc)
        if a.logs:
            Path(a.logs).mkdir(parents=True, exist_ok=True)
            shutil.copy(log, Path(a.logs) / log.name)
    half = len(ttfts) // 2
    first, later = statistics.median(ttfts[:half]), statistics.median(ttfts[half:])
    record = {
        "serving_s": round(serving_s, 2),
        "server_serving_s": None if server_serving is None else round(server_serving, 2),
        "phases_s": {p: round(v, 2) for p, v in phases.items()},
        "ttft_first_half_median_ms": round(1e3 * first, 2),
        "ttft_second_half_median_ms": round(1e3 * later, 2),
        "first_over_later": round(first / later, 3),
    }
    phases_said = ", ".join(f"{p} {v} s" for p, v in record["phases_s"].items())
    print(f"{run}: SERVING after {record['serving_s']} s (the server's count "
          f"{record['server_serving_s']} s): {phases_said}"
          + f"; TTFT median of the first {half} requests {record['ttft_first_half_median_ms']} ms, "
          f"of the next {len(ttfts) - half} {record['ttft_second_half_median_ms']} ms", flush=True)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    from tandem.bench.engine.harness import environment
    from tandem.service.cache_dirs import compile_cache_dir

    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    device = resolve_device(a.device)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-start-") as tmp:
        folder = Path(tmp)
        if a.smoke or not (a.shape or a.model):
            model = None  # the embedded model
            label = "smollm2-135m"
        elif a.shape:
            tokenizer = Path(a.tokenizer) if a.tokenizer else default_tokenizer()
            model = make_model(a.shape, tokenizer, folder, device)
            label = a.shape
        else:
            model, label = a.model, Path(a.model).name
        cache_dir = Path(a.cache_dir) if a.cache_dir else folder / "cache"
        given = {"MODEL": str(model)} if model else {}
        env = settings_env(a.set, device, CACHE_DIR=str(cache_dir), **given)
        if a.quantization:
            env["TANDEM_QUANTIZATION"] = "" if a.quantization == "none" else a.quantization
        if a.kv_cache_dtype:
            env["TANDEM_KV_CACHE_DTYPE"] = a.kv_cache_dtype
        import torch

        result = ResultFile("start", argv, torch.device(device), label, a.out)
        record: dict = {"benchmark": "start", "model": label, "smoke": a.smoke,
                        "cache_dir_given": bool(a.cache_dir), "weights_evicted": a.evict_weights,
                        "environment": environment(torch.device(device)), "runs": {}}
        for i, run in enumerate(a.run_list):
            if run == "cold":
                shutil.rmtree(compile_cache_dir(cache_dir), ignore_errors=True)
            if a.evict_weights:
                evict(weight_files(str(model) if model else None, cache_dir))
            record["runs"][run] = one_start(a, run, env, folder, i)
            result.write(record)
    print(f"wrote {result.write(record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
