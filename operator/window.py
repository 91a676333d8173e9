"""Scrapes of the last window, aggregated into the policy's MetricsWindow."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .histogram import histogram_quantile
from .policy import MetricsWindow
from .scrape import PodSample


@dataclass(frozen=True)
class Round:
    """One scrape of all ready pods."""

    time: float
    samples: tuple[PodSample, ...]


class MetricsHistory:
    def __init__(self) -> None:
        self.rounds: deque[Round] = deque()
        # When a pod last answered, kept beyond the window: the policy's MetricsStale reads it.
        self.last_answer: float | None = None

    def add(self, time: float, samples: list[PodSample], window_s: float) -> None:
        self.rounds.append(Round(time, tuple(samples)))
        if samples:
            self.last_answer = time
        while self.rounds and self.rounds[0].time < time - window_s:
            self.rounds.popleft()

    def window(self, cost_per_pod_hour: float) -> MetricsWindow | None:
        """The window of the rounds in which pods answered, observed at the newest of them; with
        none in the window, an empty one observed when a pod last answered (None if never)."""
        rounds = [r for r in self.rounds if r.samples]
        if not rounds:
            if self.last_answer is None:
                return None
            return MetricsWindow(
                observed_at=self.last_answer, pods=0, requests_running=None, requests_waiting=None
            )
        last = rounds[-1]

        def mean_of_sums(attr: str) -> float | None:
            sums = []
            for r in rounds:
                values = [getattr(s, attr) for s in r.samples]
                if any(v is None for v in values):
                    return None  # a pod that does not report it: the metric is missing
                sums.append(sum(values))
            return sum(sums) / len(sums)

        def mean(attr: str) -> float | None:
            values = [getattr(s, attr) for r in rounds for s in r.samples if getattr(s, attr) is not None]
            return sum(values) / len(values) if values else None

        firsts: dict[str, PodSample] = {}
        for r in rounds:
            for s in r.samples:
                firsts.setdefault(s.pod, s)
        tokens_per_s = self._tokens_per_s(firsts, last)
        # the newest scrape interval alone: a burst shows there before it moves the window's mean
        newest = {s.pod: s for s in rounds[-2].samples} if len(rounds) > 1 else {}
        recent = self._tokens_per_s({s.pod: newest.get(s.pod, s) for s in last.samples}, last)
        cost = None
        if tokens_per_s:
            cost = cost_per_pod_hour * len(last.samples) / (tokens_per_s * 3600) * 1e6
        return MetricsWindow(
            observed_at=last.time,
            pods=len(last.samples),
            requests_running=mean_of_sums("running"),
            requests_waiting=mean_of_sums("waiting"),
            idle_fraction=mean("idle_fraction"),
            kv_cache_usage=mean("kv_usage"),
            ttft_p95_s=self._ttft_p95(firsts, last),
            tokens_per_s=tokens_per_s,
            cost_per_mtok_usd=cost,
            capacity_tokens_per_s=self._capacity(rounds, len(last.samples)),
            recent_tokens_per_s=recent,
            admitted_per_s=self._admitted_per_s(firsts, last),
            waiting_growth_per_s=self._waiting_growth(rounds),
            counted_pods=self._counted(firsts, last),
        )

    @staticmethod
    def _capacity(rounds: list[Round], pods: int) -> float | None:
        """Mean capacity of the pods that report one, over the window, times the pods now (a pod
        whose fit has not seen enough steps yet is taken to be like the others)."""
        values = [s.capacity_tokens_per_s for r in rounds for s in r.samples]
        known = [v for v in values if v is not None and v > 0]
        return pods * sum(known) / len(known) if known else None

    @staticmethod
    def _admitted_per_s(firsts: dict[str, PodSample], last: Round) -> float | None:
        """Requests that got their first token per second (the TTFT histogram's count rate)."""
        total, span = 0.0, 0.0
        for s in last.samples:
            first = firsts[s.pod]
            if first is s or not s.ttft_buckets:
                continue
            count, before = max(s.ttft_buckets.values()), max(first.ttft_buckets.values(), default=0.0)
            total += count - before if count >= before else count  # a restart began again
            span = max(span, s.time - first.time)
        return total / span if span > 0 else None

    @staticmethod
    def _waiting_growth(rounds: list[Round]) -> float | None:
        """Slope of the pods' total waiting requests from the window's first round to its last."""
        first, last = rounds[0], rounds[-1]
        if last.time <= first.time or any(s.waiting is None for r in (first, last) for s in r.samples):
            return None
        waiting = [sum(s.waiting or 0.0 for s in r.samples) for r in (first, last)]
        return (waiting[1] - waiting[0]) / (last.time - first.time)

    @staticmethod
    def _counted(firsts: dict[str, PodSample], last: Round) -> int:
        """Pods the token rate sums: scraped twice in the window (a pod just ready is not yet)."""
        return sum(
            firsts[s.pod] is not s and None not in (s.generated_tokens, firsts[s.pod].generated_tokens)
            for s in last.samples
        )

    @staticmethod
    def _tokens_per_s(firsts: dict[str, PodSample], last: Round) -> float | None:
        total, span = 0.0, 0.0
        for s in last.samples:
            first = firsts[s.pod]
            if first is s or s.generated_tokens is None or first.generated_tokens is None:
                continue
            made = s.generated_tokens - first.generated_tokens
            if made < 0:  # the pod restarted: its counter began again
                made = s.generated_tokens
            total += made
            span = max(span, s.time - first.time)
        return total / span if span > 0 else None

    @staticmethod
    def _ttft_p95(firsts: dict[str, PodSample], last: Round) -> float | None:
        """p95 of the requests whose first token came within the window (bucket increases)."""
        increase: dict[float, float] = {}
        for s in last.samples:
            first = firsts[s.pod]
            if first is s:
                continue  # one scrape of a pod: its counts span its whole life, not the window
            for le, count in s.ttft_buckets.items():
                before = first.ttft_buckets.get(le, 0.0)
                delta = count - before if count >= before else count
                increase[le] = increase.get(le, 0.0) + delta
        if not increase:
            return None
        bounds = sorted(increase)
        return histogram_quantile(0.95, bounds, [increase[b] for b in bounds])
