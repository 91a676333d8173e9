"""Simulated Tandem pods and the cluster of them, at one-second resolution.

A pod's speed and start come from a calibration file of measured numbers (calibration.py: a decode
step's time against its sequences and the context they attend, the prefill rate, the KV cache);
prefill takes its time out of the same second as decode.

Requests are fluid cohorts (fractional counts), admitted FIFO while a pod has fewer than
max_num_seqs sequences and KV-cache room for their full length. An admitted request is prefilled
FIFO, then decodes; until its prefill is done it counts as waiting, as the engine's scheduler
counts a request until its prefill is scheduled (`tandem_requests_waiting`).

Two representations make a day of traffic cheap to simulate without changing the model:
- every running cohort of a pod advances by the same number of decode steps each second, so a
  cohort is kept as the step count at which it finishes (a heap), and totals are kept as sums;
- pods started together get the same share of every arrival and so stay identical: they are one
  `Pod` with `copies`, split only when some of them are removed.
"""

from __future__ import annotations

import bisect
import copy
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tandem.bench.autoscale.calibration import PodModel, load

# Share of a second prefill may take while sequences decode (chunked prefill, decode first).
PREFILL_SHARE = 0.9
# TTFT histogram buckets: the OpenTelemetry GenAI conventions' (as the server exports them)
TTFT_BUCKETS = np.array([0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, np.inf])  # fmt: skip
_BOUNDS = TTFT_BUCKETS.tolist()
# a cohort with at most this many tokens left is done (fluid counts, float steps)
_EPS = 1e-9
# pods whose work differs by less than this are merged (Cluster.merge): tokens, relative count
_SAME_TOKENS = 1e-3
_SAME_COUNT = 1e-9
# how often the cluster looks for pods to merge, seconds
MERGE_EVERY_S = 30
# The pod's traffic mix (context per decode row, prefill tokens per generated token) is kept as
# sums forgotten by this much a second: the server's capacity fit forgets 0.1% a step, about the
# last 10-20 s at 50-100 steps a second.
MIX_FORGET = 0.95


class PodSecond(NamedTuple):
    """What one pod did in one second (the basis of its metrics)."""

    running: float
    waiting: float
    kv_usage: float
    idle: float  # share of the second with no step in flight; GPU utilisation (DCGM) is 1 - idle
    tokens: float
    capacity: float  # tokens/s at the pod's traffic mix, as it reports it; 0 before traffic


@dataclass
class Pod:
    ready_at: float
    model: PodModel
    copies: int = 1  # identical pods this object stands for; the fields below are per pod
    max_num_seqs: int = 256
    capacity_bias: float = 1.0  # what its capacity gauge reads against the truth (the server fits it)
    draining: bool = False
    steps: float = 0.0  # decode steps made since the pod started
    # admitted, prefill not done, FIFO: [prompt tokens left, arrival, prompt, output]
    prefilling: deque[list[float]] = field(default_factory=deque)
    prefill_backlog: float = 0.0  # their prompt tokens left, in all
    # decoding cohorts, a heap: (finish step, decoding since, arrival, prompt, count, total length,
    # prompt - step it began decoding at); the times and the prompt name a cohort across pods
    cohorts: list[tuple[float, float, float, float, float, float, float]] = field(default_factory=list)
    seqs: float = 0.0  # admitted requests, prefilling or decoding (max_num_seqs counts them)
    reserved: float = 0.0  # count x total length of the admitted (KV-cache admission)
    running: float = 0.0  # decoding requests
    kv_base: float = 0.0  # sum of count x (prompt - step it began at): K/V held = kv_base + steps x running
    queue: deque[list[float]] = field(default_factory=deque)  # [arrival, count, prompt, output]
    queued: float = 0.0  # requests in the queue (kept, not summed: a saturated pod's queue is long)
    unprefilled: float = 0.0  # requests in `prefilling` (the same)
    # forgotten sums of the traffic mix (MIX_FORGET): decode rows, context held, prefill, generated
    mix: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining

    @property
    def load(self) -> float:
        return self.seqs + self.queued

    def empty(self) -> bool:
        return not self.queue and not self.prefilling and not self.cohorts

    def output_in_flight(self) -> float:
        """Output tokens per pod still to generate: decoding, prefilling and queued."""
        left = sum(c[4] * (c[0] - self.steps) for c in self.cohorts)
        left += sum(p[0] / p[2] * p[3] for p in self.prefilling)
        return left + sum(q[1] * q[3] for q in self.queue)

    def split(self, copies: int) -> Pod:
        """Take `copies` of these identical pods out as their own object."""
        assert 0 < copies < self.copies
        other = copy.deepcopy(self, {id(self.model): self.model})
        other.copies, self.copies = copies, self.copies - copies
        return other

    def same_as(self, other: Pod) -> bool:
        """Whether two pods hold the same work, to within a thousandth of a token: pods that
        started apart converge once they have served the same arrivals (see Cluster.merge)."""
        if self.queue or other.queue or self.prefilling or other.prefilling:
            return False
        if len(self.cohorts) != len(other.cohorts):
            return False
        mine, theirs = self._by_cohort(), other._by_cohort()
        if mine.keys() != theirs.keys():
            return False
        for key, (count, left) in mine.items():
            count_b, left_b = theirs[key]
            if abs(count - count_b) > _SAME_COUNT * max(count, 1.0) or abs(left - left_b) > _SAME_TOKENS:
                return False
        return True

    def _by_cohort(self) -> dict[tuple[float, float, float], list[float]]:
        held: dict[tuple[float, float, float], list[float]] = {}
        for finish, since, arrival, prompt, count, _, _ in self.cohorts:
            h = held.setdefault((since, arrival, prompt), [0.0, 0.0])
            h[0] += count
            h[1] += count * (finish - self.steps)
        return held

    def _admit(self, now: float, ttft: list[float]) -> None:
        # the hot loop of the simulation: locals, one helper call a cohort
        queue, prefilling, copies, model = self.queue, self.prefilling, self.copies, self.model
        seqs, reserved, backlog = self.seqs, self.reserved, self.prefill_backlog
        kv_capacity = model.kv_capacity_tokens
        prefill_s_per_token = 1.0 / (model.prefill_tokens_per_s * PREFILL_SHARE)  # decode runs beside it
        # the K/V its first decode step reads: what the decoding cohorts hold
        first_step_kv = model.kv_read_s_per_token * (self.kv_base + self.steps * self.running)
        admitted = 0.0
        while queue:
            head = queue[0]
            arrival, n, prompt, output = head
            length = prompt + output
            take = self.max_num_seqs - seqs
            kv_room = (kv_capacity - reserved) / length
            if kv_room < take:
                take = kv_room
            if n < take:
                take = n
            if take <= 1e-9:
                break
            # the cohort's middle request waits for the backlog and half the cohort's prompts
            wait = (now - arrival) + (backlog + prompt * (take + 1) / 2) * prefill_s_per_token
            ttft[bisect.bisect_left(_BOUNDS, wait + model.base_s(seqs) + first_step_kv)] += take * copies
            backlog += take * prompt
            prefilling.append([take * prompt, arrival, prompt, output])
            seqs += take
            admitted += take
            reserved += take * length
            if take >= n - 1e-9:
                queue.popleft()
            else:
                head[1] = n - take
        self.seqs, self.reserved, self.prefill_backlog = seqs, reserved, backlog
        self.queued = self.queued - admitted if queue else 0.0
        self.unprefilled += admitted

    def _prefill(self, now: float, tokens: float) -> None:
        """Prefill `tokens` of the backlog, FIFO; the requests done start decoding."""
        prefilling, steps = self.prefilling, self.steps
        self.prefill_backlog -= tokens
        while prefilling and tokens > 0:
            head = prefilling[0]
            left, arrival, prompt, output = head
            done = min(left, tokens)
            tokens -= done
            count = done / prompt  # fluid: this many of the cohort's requests are prefilled
            if left - done <= _EPS * prompt:
                prefilling.popleft()
                count = left / prompt
            else:
                head[0] = left - done
            self.running += count
            self.unprefilled -= count
            self.kv_base += count * (prompt - steps)
            heapq.heappush(
                self.cohorts, (steps + output, now, arrival, prompt, count, prompt + output, prompt - steps)
            )
        if not prefilling:
            self.prefill_backlog = self.unprefilled = 0.0

    def step(self, now: float, ttft: list[float]) -> PodSecond:
        """One second: admit, prefill, decode. Adds this pod's admissions to `ttft` (all copies)."""
        model = self.model
        self._admit(now, ttft)
        prefilled = min(self.prefill_backlog, PREFILL_SHARE * model.prefill_tokens_per_s)
        if prefilled > 0:
            self._prefill(now, prefilled)
        prefill_s = prefilled / model.prefill_tokens_per_s
        running = self.running
        tokens = 0.0
        cohorts = self.cohorts
        if cohorts:
            held = self.kv_base + self.steps * running  # the context the steps attend, growing
            steps = model.decode_steps(1.0 - prefill_s, running, held)
            done = self.steps + steps
            tokens = steps * running
            while cohorts and cohorts[0][0] - done <= _EPS:
                finish, _, _, _, count, length, base = heapq.heappop(cohorts)
                if finish < done:  # it needed fewer steps than the second had
                    tokens -= count * (done - finish)
                self.running -= count
                self.seqs -= count
                self.reserved -= count * length
                self.kv_base -= count * base
            self.steps = done
            if not cohorts:  # exact zeros, not the rounding left by the sums
                self.running = self.kv_base = 0.0
                if not self.prefilling:
                    self.seqs = self.reserved = 0.0
            idle = 0.001  # the asynchronous loop keeps the device busy (0.1% idle measured)
        else:
            idle = 1.0 - prefill_s
        held = self.kv_base + self.steps * self.running
        kv = held / model.kv_capacity_tokens
        mix = self.mix
        for i, value in enumerate((running, held, prefilled, tokens)):
            mix[i] = MIX_FORGET * mix[i] + value
        capacity = 0.0
        if mix[3] > 0:
            capacity = self.capacity_bias * model.capacity_tokens_per_s(
                mix[1] / max(mix[0], 1e-9), mix[2] / mix[3], self.max_num_seqs
            )
        # waiting as the engine counts it: queued, or admitted with its prefill not yet done
        return PodSecond(running, self.queued + self.unprefilled, kv, idle, tokens, capacity)


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
    ttft_buckets: list[float]  # requests admitted this second by TTFT bucket, over all pods
    capacity: float = 0.0  # sum of the ready pods' capacity gauges (tokens/s), over those that report one
    capacity_pods: int = 0  # ready pods that report a capacity (they have had traffic)
    capacity_tokens: float = 0.0  # tokens generated this second by those pods


class Cluster:
    def __init__(
        self,
        replicas: int,
        cold_start_s: float,
        max_num_seqs: int = 256,
        model: PodModel | None = None,
        capacity_bias: float = 1.0,
    ) -> None:
        self.cold_start_s = cold_start_s
        self.max_num_seqs = max_num_seqs
        self.model = model or load()
        self.capacity_bias = capacity_bias
        self.pods = [self._new(0.0, replicas)] if replicas else []
        self.replicas = replicas
        self.pending: list[list[float]] = []  # arrivals with no ready pod to go to

    def _new(self, ready_at: float, copies: int) -> Pod:
        return Pod(ready_at, self.model, copies, self.max_num_seqs, capacity_bias=self.capacity_bias)

    def active(self) -> list[Pod]:
        return [p for p in self.pods if not p.draining]

    def scale(self, replicas: int, now: float) -> None:
        self.replicas = replicas
        active = self.active()
        have = sum(p.copies for p in active)
        if replicas > have:
            self.pods.append(self._new(now + self.cold_start_s, replicas - have))
        remove = have - replicas
        # like the ReplicaSet controller: pods not yet ready go first, then the least loaded
        for pod in sorted(active, key=lambda p: (p.ready(now), p.load)):
            if remove <= 0:
                break
            if pod.copies > remove:
                pod = pod.split(remove)
                self.pods.append(pod)
            remove -= pod.copies
            pod.draining = True
            # clients retry elsewhere what was not admitted
            self.pending.extend([a, n * pod.copies, p, o] for a, n, p, o in pod.queue)
            pod.queue.clear()
            pod.queued = 0.0

    def route(self, now: float, arrivals: list[list[float]]) -> None:
        ready = [p for p in self.pods if p.ready(now)]
        work = self.pending + arrivals
        if not ready:
            self.pending = work
            return
        self.pending = []
        share = 1.0 / sum(p.copies for p in ready)  # an even split: many clients over a Service
        total = share * sum(w[1] for w in work)
        for pod in ready:
            pod.queue.extend([arrival, n * share, prompt, output] for arrival, n, prompt, output in work)
            pod.queued += total

    def merge(self, now: float) -> None:
        """Make one object of ready pods that hold the same work. Pods started at different times
        get the same arrivals from the moment both are ready, so once the older pod's earlier
        requests are done the two hold the same cohorts; from then on they would step alike."""
        ready = [p for p in self.pods if p.ready(now)]
        gone: set[int] = set()
        for i, pod in enumerate(ready):
            if id(pod) in gone:
                continue
            for other in ready[i + 1 :]:
                if id(other) not in gone and pod.same_as(other):
                    pod.copies += other.copies
                    gone.add(id(other))
        if gone:
            self.pods = [p for p in self.pods if id(p) not in gone]

    def output_in_flight(self) -> float:
        """Output tokens still to generate, over all pods and the pending arrivals."""
        pods = sum(p.copies * p.output_in_flight() for p in self.pods)
        return pods + sum(q[1] * q[3] for q in self.pending)

    def step(self, now: float) -> Snapshot:
        ttft = [0.0] * len(_BOUNDS)
        pods = ready = 0
        running = waiting = kv = idle = tokens = capacity = capacity_tokens = 0.0
        capacity_pods = 0
        for pod in self.pods:
            s = pod.step(now, ttft)
            c = pod.copies
            pods += c
            tokens += c * s.tokens
            if pod.ready(now):
                ready += c
                running += c * s.running
                waiting += c * s.waiting
                kv += c * s.kv_usage
                idle += c * s.idle
                if s.capacity > 0:
                    capacity += c * s.capacity
                    capacity_pods += c
                    capacity_tokens += c * s.tokens
        if any(p.draining for p in self.pods):
            self.pods = [p for p in self.pods if not (p.draining and p.empty())]
        if now % MERGE_EVERY_S == 0 and len(self.pods) > 1:
            self.merge(now)
        n = max(ready, 1)
        return Snapshot(
            time=now,
            replicas=self.replicas,
            pods=pods,
            ready=ready,
            running=running,
            waiting=waiting + sum(q[1] for q in self.pending),
            kv_usage=kv / n,
            idle=idle / n,
            util=(ready - idle) / n,
            tokens=tokens,
            ttft_buckets=ttft,
            capacity=capacity,
            capacity_pods=capacity_pods,
            capacity_tokens=capacity_tokens,
        )
