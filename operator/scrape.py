"""Read one pod's Prometheus /metrics and keep what the scaling policy needs."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# Metric names as the server exports them (DESIGN.md section 4); families without _total etc.
RUNNING = "tandem_requests_running"
WAITING = "tandem_requests_waiting"
KV_USAGE = "tandem_kv_cache_usage_ratio"
IDLE = "tandem_gpu_idle_fraction"
GENERATED = "tandem_generation_tokens"  # counter: samples named ..._total
TTFT = "gen_ai_server_time_to_first_token_seconds"  # histogram


def metrics_url(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 pod addresses need brackets
    return f"http://{host}:{port}/metrics"


@dataclass(frozen=True)
class PodSample:
    pod: str
    time: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    idle_fraction: float | None = None
    generated_tokens: float | None = None  # counter value
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count


def parse_metrics(pod: str, when: float, text: str) -> PodSample:
    """Gauges and counters are summed over label sets (one model per pod: usually one set)."""
    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == TTFT and sample.name == TTFT + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif family.name in (RUNNING, WAITING, KV_USAGE, IDLE) and sample.name == family.name:
                values[family.name] = values.get(family.name, 0.0) + sample.value
            elif family.name == GENERATED and sample.name == GENERATED + "_total":
                values[GENERATED] = values.get(GENERATED, 0.0) + sample.value
    clean = {k: v for k, v in values.items() if not math.isnan(v)}
    return PodSample(
        pod=pod,
        time=when,
        running=clean.get(RUNNING),
        waiting=clean.get(WAITING),
        kv_usage=clean.get(KV_USAGE),
        idle_fraction=clean.get(IDLE),
        generated_tokens=clean.get(GENERATED),
        ttft_buckets=dict(sorted(buckets.items())),
    )


async def scrape_pod(
    session: aiohttp.ClientSession,
    limit: asyncio.Semaphore,
    pod: str,
    url: str,
    timeout_s: float,
    now: float,
) -> PodSample | None:
    """The pod's sample, or None when it did not answer in time or answered garbage."""
    async with limit:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status != 200:
                    return None
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
    try:
        return parse_metrics(pod, now, text)
    except ValueError:
        return None
