"""The engine-only side of `tandem bench serve`: the same model, settings and request lengths through
the engine core alone, in this process, with no front, no IPC and no client (its prompts are a pass
of their own: serve/benchmark.py).

    python -m tandem.bench.serve.engine_alone SPEC.json OUT.json   (settings from the TANDEM_* environment)

Fixed concurrency keeps that many requests in the engine, adding the next as one finishes; request
rate adds each request at its arrival time. The core is built by the server's own factory from the
server's own settings, so what differs from `tandem serve` is the server alone.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Sequence

from tandem.bench.common import percentile
from tandem.bench.engine.harness import copy_bandwidth, failures, token_rows
from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.factory import build_engine, configure_threads, resolve_device
from tandem.service.engine.ops.kv_cache import CacheShape
from tandem.service.models.loader import load_model
from tandem.service.runtime.engine_process import warm_up
from tandem.service.settings import ServerSettings


def run_level(core: EngineCore, jobs: list[dict], concurrency: int | None) -> dict:
    """Every request of the level through `core`; per-request times as a client records them."""
    pending = deque(enumerate(jobs))
    records: dict[str, dict] = {}
    running = 0
    step_ms: list[float] = []
    steps0, busy0 = core.steps, core.busy_seconds
    t0 = time.time()
    while pending or core.has_work:
        now = time.time()
        while pending and (running < concurrency if concurrency else t0 + pending[0][1]["at"] <= now):
            i, job = pending.popleft()
            rid = f"e{i}"
            records[rid] = {
                "start": time.time(),
                "prompt_tokens": len(job["prompt_ids"]),
                "first": None,
                "end": None,
                "tokens": 0,
                "messages": 0,
                "itl": [],
                "cached_tokens": None,
                "error": None,
                "_last": None,
            }
            params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
            core.add(Request(rid, job["prompt_ids"], params))
            running += 1
        if not core.has_work:  # request rate: nothing runs until the next arrival
            time.sleep(max(0.0, t0 + pending[0][1]["at"] - time.time()))
            continue
        before, started = core.steps, time.perf_counter()
        outputs = core.run_once()
        if core.steps > before:
            step_ms.append(1e3 * (time.perf_counter() - started))
        now = time.time()
        for rid, why in failures(outputs):
            records[rid]["error"], records[rid]["end"] = why, now
            running -= 1
        for u in token_rows(outputs):
            rec = records[u.request_id]
            if u.cached is not None:  # the prompt tokens the prefix cache held, as the server's usage says
                rec["cached_tokens"] = u.cached
            if rec["first"] is None:
                rec["first"] = now
            else:
                rec["itl"].append(now - rec["_last"])
            rec["_last"] = now
            rec["tokens"] += 1
            rec["messages"] += 1
            if u.finish is not None:
                rec["end"] = now
                running -= 1
    wall = time.time() - t0
    for rec in records.values():
        del rec["_last"]
    return {
        "requests": list(records.values()),
        "median_step_ms": round(percentile(step_ms, 50), 3) if step_ms else None,
        "steps": core.steps - steps0,
        "engine_idle": round(max(0.0, 1 - (core.busy_seconds - busy0) / wall), 4),
    }


def roofline_step_ms(
    weight_bytes: int, kv_bytes_per_token: int, bandwidth: float, jobs: list[dict], concurrency: int | None
) -> float | None:
    """A decode step's memory floor at this level: every weight byte, plus the K/V of `concurrency`
    sequences at the level's mean context (prompt + half the answer), at the copy bandwidth."""
    if not concurrency:
        return None
    context = sum(len(j["prompt_ids"]) + j["max_tokens"] / 2 for j in jobs) / len(jobs)
    return round(1e3 * (weight_bytes + concurrency * context * kv_bytes_per_token) / bandwidth, 3)


def main(argv: Sequence[str] | None = None) -> int:
    spec_path, out_path = sys.argv[1:] if argv is None else argv
    spec = json.loads(open(spec_path).read())
    settings = ServerSettings()
    device = resolve_device(settings.device)
    configure_threads(settings, device)  # as the engine process does
    loaded = load_model(settings.model, settings.model_name, device, settings.dtype, settings.cache_dir)
    core, limits = build_engine(loaded, settings)
    warm_up(core, limits)
    if spec.get("warmup"):
        run_level(core, spec["warmup"]["jobs"], spec["warmup"]["concurrency"])
    results = [run_level(core, level["jobs"], level.get("concurrency")) for level in spec["levels"]]
    if device.type == "cuda":
        model = loaded.model
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        kv = CacheShape.of(model.config).bytes_per_token(core.runner.cache.k_store.dtype)
        bandwidth = copy_bandwidth(device)
        for result, level in zip(results, spec["levels"], strict=True):
            result["roofline_step_ms"] = roofline_step_ms(
                weights, kv, bandwidth, level["jobs"], level.get("concurrency")
            )
            result["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
