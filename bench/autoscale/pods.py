"""Simulated Tandem pods and the cluster of them, at one-second resolution.

A pod's speed comes from Tandem's measurements on one H200, Llama-3.1-8B shape, bf16
(docs/benchmarks.md, bench/results/gpu_sync_8b*.json): a decode step of c sequences takes
7.85 ms + 0.0494 ms x c (126 tokens/s for one stream, 3,404 tokens/s at 32, 12,163 at 256).
Prefill runs at PREFILL_TOKENS_PER_S (an estimate, not measured: ~40% of the H200's dense bf16
peak at 16 GFLOP per token of the 8B model) and takes its time out of the same second as decode.

Requests are fluid cohorts (fractional counts), admitted FIFO while a pod has fewer than
max_num_seqs sequences and KV-cache room for their full length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STEP_BASE_S = 0.00785
STEP_PER_SEQ_S = 0.0000494
PREFILL_TOKENS_PER_S = 25_000.0
# Share of a second prefill may take while sequences decode (chunked prefill, decode first).
PREFILL_SHARE = 0.9
# H200 141 GB: 85% of what the 16 GB of weights leave, at 128 KiB of K/V per token
KV_CAPACITY_TOKENS = 0.85 * 125e9 / (128 * 1024)
# TTFT histogram buckets: the OpenTelemetry GenAI conventions' (as the server exports them)
TTFT_BUCKETS = np.array([0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, np.inf])  # fmt: skip


def step_seconds(sequences: float) -> float:
    return STEP_BASE_S + STEP_PER_SEQ_S * sequences


@dataclass
class PodSecond:
    """What one pod did in one second (the basis of its metrics)."""

    running: float
    waiting: float
    kv_usage: float
    idle: float  # share of the second with no step in flight
    util: float  # what nvidia-smi / DCGM would call GPU utilisation
    tokens: float
    ttft_buckets: np.ndarray  # requests admitted this second, by TTFT bucket


@dataclass
class Pod:
    ready_at: float
    max_num_seqs: int = 256
    draining: bool = False
    # running cohorts: count, remaining output tokens each, total length (prompt + output)
    count: np.ndarray = field(default_factory=lambda: np.zeros(0))
    remaining: np.ndarray = field(default_factory=lambda: np.zeros(0))
    length: np.ndarray = field(default_factory=lambda: np.zeros(0))
    used: np.ndarray = field(default_factory=lambda: np.zeros(0))  # prompt + generated so far
    queue: list[list[float]] = field(default_factory=list)  # [arrival, count, prompt, output]
    prefill_backlog: float = 0.0  # prompt tokens admitted but not yet prefilled

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining

    @property
    def load(self) -> float:
        return float(self.count.sum()) + sum(q[1] for q in self.queue)

    def empty(self) -> bool:
        return not self.queue and self.count.size == 0

    def _admit(self, now: float, ttft: np.ndarray) -> None:
        running = float(self.count.sum())
        reserved = float((self.count * self.length).sum())
        new_c, new_r, new_l, new_u = [], [], [], []
        while self.queue:
            arrival, n, prompt, output = self.queue[0]
            room = min(self.max_num_seqs - running, (KV_CAPACITY_TOKENS - reserved) / (prompt + output))
            take = min(n, room)
            if take <= 1e-9:
                break
            # the cohort's middle request waits for the backlog and half the cohort's prompts
            wait = (now - arrival) + (self.prefill_backlog + prompt * (take + 1) / 2) / (
                PREFILL_TOKENS_PER_S * PREFILL_SHARE
            )
            ttft[np.searchsorted(TTFT_BUCKETS, wait + step_seconds(running))] += take
            self.prefill_backlog += take * prompt
            running += take
            reserved += take * (prompt + output)
            new_c.append(take), new_r.append(output), new_l.append(prompt + output), new_u.append(prompt)
            if take >= n - 1e-9:
                self.queue.pop(0)
            else:
                self.queue[0][1] = n - take
        if new_c:
            self.count = np.concatenate([self.count, new_c])
            self.remaining = np.concatenate([self.remaining, new_r])
            self.length = np.concatenate([self.length, new_l])
            self.used = np.concatenate([self.used, new_u])

    def step(self, now: float) -> PodSecond:
        ttft = np.zeros(len(TTFT_BUCKETS))
        self._admit(now, ttft)
        running = float(self.count.sum())
        prefilled = min(self.prefill_backlog, PREFILL_SHARE * PREFILL_TOKENS_PER_S)
        self.prefill_backlog -= prefilled
        prefill_s = prefilled / PREFILL_TOKENS_PER_S
        tokens = 0.0
        if running > 0:
            steps = (1.0 - prefill_s) / step_seconds(running)
            made = np.minimum(self.remaining, steps)
            tokens = float((made * self.count).sum())
            self.remaining = self.remaining - made
            self.used = self.used + made
            keep = self.remaining > 1e-9
            self.count, self.remaining = self.count[keep], self.remaining[keep]
            self.length, self.used = self.length[keep], self.used[keep]
            idle = 0.001  # the asynchronous loop keeps the device busy (0.1% idle measured)
        else:
            idle = 1.0 - prefill_s
        kv = float((self.count * self.used).sum()) / KV_CAPACITY_TOKENS
        waiting = sum(q[1] for q in self.queue)
        return PodSecond(running, waiting, kv, idle, 1.0 - idle, tokens, ttft)


@dataclass
class Snapshot:
    """The cluster in one second, over its ready pods (what a scraper would see)."""

    time: float
    replicas: int  # what the scaler asked for
    pods: int  # pods that cost money (starting, ready, draining)
    ready: int
    running: float
    waiting: float
    kv_usage: float  # mean over ready pods
    idle: float  # mean over ready pods
    util: float  # mean over ready pods
    tokens: float  # generated by all pods
    ttft_buckets: np.ndarray  # over all pods


class Cluster:
    def __init__(self, replicas: int, cold_start_s: float, max_num_seqs: int = 256) -> None:
        self.cold_start_s = cold_start_s
        self.max_num_seqs = max_num_seqs
        self.pods = [Pod(ready_at=0.0, max_num_seqs=max_num_seqs) for _ in range(replicas)]
        self.replicas = replicas
        self.pending: list[list[float]] = []  # arrivals with no ready pod to go to

    def active(self) -> list[Pod]:
        return [p for p in self.pods if not p.draining]

    def scale(self, replicas: int, now: float) -> None:
        self.replicas = replicas
        active = self.active()
        for _ in range(replicas - len(active)):
            self.pods.append(Pod(ready_at=now + self.cold_start_s, max_num_seqs=self.max_num_seqs))
        if replicas < len(active):
            # like the ReplicaSet controller: pods not yet ready go first, then the least loaded
            victims = sorted(active, key=lambda p: (p.ready(now), p.load))[: len(active) - replicas]
            for pod in victims:
                pod.draining = True
                self.pending.extend(pod.queue)  # clients retry elsewhere what was not admitted
                pod.queue = []

    def route(self, now: float, arrivals: list[list[float]]) -> None:
        ready = [p for p in self.pods if p.ready(now)]
        work = self.pending + arrivals
        if not ready:
            self.pending = work
            return
        self.pending = []
        share = 1.0 / len(ready)  # an even split: many clients over a Service
        for arrival, n, prompt, output in work:
            for pod in ready:
                pod.queue.append([arrival, n * share, prompt, output])

    def step(self, now: float) -> Snapshot:
        seconds = [(p, p.step(now)) for p in self.pods]
        self.pods = [p for p in self.pods if not (p.draining and p.empty())]
        ready = [s for p, s in seconds if p.ready(now)]
        n = max(len(ready), 1)
        return Snapshot(
            time=now,
            replicas=self.replicas,
            pods=len(seconds),
            ready=len(ready),
            running=sum(s.running for s in ready),
            waiting=sum(s.waiting for s in ready) + sum(q[1] for q in self.pending),
            kv_usage=sum(s.kv_usage for s in ready) / n,
            idle=sum(s.idle for s in ready) / n,
            util=sum(s.util for s in ready) / n,
            tokens=sum(s.tokens for _, s in seconds),
            ttft_buckets=sum((s.ttft_buckets for _, s in seconds), np.zeros(len(TTFT_BUCKETS))),
        )
