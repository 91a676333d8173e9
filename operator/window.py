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
