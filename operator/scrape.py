"""Read one pod's Prometheus /metrics and keep what the scaling policy needs.

A pod's body is untrusted input: whatever it sends (no answer, an error status, bytes that are
not UTF-8, text the parser refuses, a value that is not a finite number in range), the result is
either a sample or an `Unreadable` naming the problem, never an exception, so that one bad pod
cannot stop the decisions for the others.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# Metric names as the server exports them (DESIGN.md section 4); families without _total etc.
RUNNING = "tandem_requests_running"
WAITING = "tandem_requests_waiting"
KV_USAGE = "tandem_kv_cache_usage_ratio"
IDLE = "tandem_gpu_idle_fraction"
CAPACITY = "tandem_capacity_tokens_per_second"  # what the pod measured it can generate at its mix
GENERATED = "tandem_generation_tokens"  # counter: samples named ..._total
TTFT = "gen_ai_server_time_to_first_token_seconds"  # histogram
STARTUP = "tandem_startup_seconds"  # by phase: how the server's start went (for the pod's Event)
SERVING_AFTER = "tandem_startup_serving_seconds"
REQUIRED = (RUNNING, WAITING)  # without these a pod's load is unknown
RATIOS = (KV_USAGE, IDLE)  # 0-1
# The server's /metrics is a few kilobytes; a body far beyond that is not one.
MAX_BODY_BYTES = 4 * 1024 * 1024


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
    # None until the pod's fit has seen enough steps (or from a server that does not export it)
    capacity_tokens_per_s: float | None = None
    # the server's start: seconds from its process's start to SERVING, and by phase (optional)
    serving_after_s: float | None = None
    startup_phases: dict[str, float] = field(default_factory=dict)


# What went wrong with a pod's /metrics, as one word of a fixed set (a bounded metric label).
TIMEOUT, UNREACHABLE, HTTP_STATUS, TOO_LARGE = "Timeout", "Unreachable", "HTTPStatus", "TooLarge"
NOT_UTF8, NOT_PROMETHEUS, MISSING_METRIC, BAD_VALUE = "NotUTF8", "NotPrometheus", "MissingMetric", "BadValue"
PROBLEM_KINDS = (
    TIMEOUT,
    UNREACHABLE,
    HTTP_STATUS,
    TOO_LARGE,
    NOT_UTF8,
    NOT_PROMETHEUS,
    MISSING_METRIC,
    BAD_VALUE,
)
MISSING = "does not export"


@dataclass(frozen=True)
class Unreadable:
    """A ready pod whose metrics could not be used this round, and why (for its condition)."""

    pod: str
    problem: str
    kind: str  # one of PROBLEM_KINDS


def parse_metrics(pod: str, when: float, text: str) -> PodSample:
    """Gauges and counters are summed over label sets (one model per pod: usually one set)."""
    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    phases: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == TTFT and sample.name == TTFT + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif family.name in (RUNNING, WAITING, KV_USAGE, IDLE, CAPACITY) and sample.name == family.name:
                values[family.name] = values.get(family.name, 0.0) + sample.value
            elif family.name == GENERATED and sample.name == GENERATED + "_total":
                values[GENERATED] = values.get(GENERATED, 0.0) + sample.value
            elif family.name == STARTUP and sample.name == STARTUP and "phase" in sample.labels:
                phases[sample.labels["phase"]] = sample.value
            elif family.name == SERVING_AFTER and sample.name == SERVING_AFTER:
                values[SERVING_AFTER] = sample.value
    return PodSample(
        pod=pod,
        time=when,
        running=values.get(RUNNING),
        waiting=values.get(WAITING),
        kv_usage=values.get(KV_USAGE),
        idle_fraction=values.get(IDLE),
        generated_tokens=values.get(GENERATED),
        ttft_buckets=dict(sorted(buckets.items())),
        capacity_tokens_per_s=values.get(CAPACITY),
        serving_after_s=values.get(SERVING_AFTER),
        startup_phases=phases,
    )


def problem_of(sample: PodSample) -> str | None:
    """Why the sample cannot be used, or None: a required metric missing, or a value the policy
    must not see (not finite, negative, a ratio outside 0-1)."""
    named = {
        RUNNING: sample.running,
        WAITING: sample.waiting,
        KV_USAGE: sample.kv_usage,
        IDLE: sample.idle_fraction,
        GENERATED + "_total": sample.generated_tokens,
        CAPACITY: sample.capacity_tokens_per_s,
    }
    for name in REQUIRED:
        if named[name] is None:
            return f"{MISSING} {name}"
    for name, value in named.items():
        if value is None:
            continue
        if not math.isfinite(value) or value < 0:
            return f"{name} is {value}"
        if name in RATIOS and value > 1:
            return f"{name} is {value}, not within 0-1"
    for le, count in sample.ttft_buckets.items():
        if math.isnan(le) or not math.isfinite(count) or count < 0:
            return f"{TTFT}_bucket{{le={le}}} is {count}"
    return None


async def _body(response: aiohttp.ClientResponse) -> bytes | None:
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def scrape_pod(
    session: aiohttp.ClientSession,
    limit: asyncio.Semaphore,
    pod: str,
    url: str,
    timeout_s: float,
) -> PodSample | Unreadable:
    """The pod's sample, or what made it unreadable this round. The sample is timed when the pod's
    answer began to arrive (it renders its counters before it sends the head), not when the round
    began: a rate over two scrapes then spans the interval its counters did, however long each
    answer waited on a busy pod or host."""
    async with limit:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                answered = time.time()
                if response.status != 200:
                    return Unreadable(pod, f"/metrics answered HTTP {response.status}", HTTP_STATUS)
                body = await _body(response)
        except asyncio.TimeoutError:
            return Unreadable(pod, f"/metrics did not answer within {timeout_s:g} s", TIMEOUT)
        except (aiohttp.ClientError, OSError) as exc:
            return Unreadable(pod, f"/metrics unreachable: {type(exc).__name__}", UNREACHABLE)
    if body is None:
        return Unreadable(
            pod, f"/metrics body is larger than {MAX_BODY_BYTES // 1024 // 1024} MiB", TOO_LARGE
        )
    return read_body(pod, answered, body)


def read_body(pod: str, now: float, body: bytes) -> PodSample | Unreadable:
    """A /metrics body, whatever its bytes, as a usable sample or the reason it is not one."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return Unreadable(pod, "/metrics body is not UTF-8 text", NOT_UTF8)
    try:
        sample = parse_metrics(pod, now, text)
    except Exception as exc:  # untrusted text: whatever the parser raises, only this pod is lost
        return Unreadable(pod, f"/metrics is not Prometheus text ({type(exc).__name__})", NOT_PROMETHEUS)
    problem = problem_of(sample)
    if problem is None:
        return sample
    return Unreadable(pod, problem, MISSING_METRIC if problem.startswith(MISSING) else BAD_VALUE)
