"""The operator's reading of pod metrics: Prometheus text from a real prometheus_client registry,
parsed with prometheus_client's parser, aggregated over a window, quantiles from buckets."""

from __future__ import annotations

import asyncio
import math
import random
import time

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubelet import Addresses, MetricsPod
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.operator.histogram import histogram_quantile
from tandem.operator.scrape import PodSample, Unreadable, metrics_url, parse_metrics, read_body, scrape_pod
from tandem.operator.window import MetricsHistory

BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class FakeServer:
    """The server's metric names on a real registry (what /metrics would serve)."""

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        names = list(labels or {})
        self.labels = labels or {}
        self.running = Gauge("tandem_requests_running", "running", names, registry=r)
        self.waiting = Gauge("tandem_requests_waiting", "waiting", names, registry=r)
        self.kv = Gauge("tandem_kv_cache_usage_ratio", "kv", names, registry=r)
        self.idle = Gauge("tandem_gpu_idle_fraction", "idle", names, registry=r)
        self.tokens = Counter("tandem_generation_tokens", "tokens", names, registry=r)
        self.capacity = Gauge("tandem_capacity_tokens_per_second", "capacity", names, registry=r)
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds", "ttft", names, buckets=BUCKETS, registry=r
        )
        Gauge("tandem_cost_per_million_tokens_usd", "cost", registry=r).set(1.0)  # present, not used

    def m(self, metric):  # noqa: ANN001, ANN201
        return metric.labels(**self.labels) if self.labels else metric

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_parse_reads_every_signal():
    s = FakeServer({"model": "smol"})
    s.m(s.running).set(3)
    s.m(s.waiting).set(2)
    s.m(s.kv).set(0.25)
    s.m(s.idle).set(0.1)
    s.m(s.tokens).inc(1234)
    s.m(s.capacity).set(9000.0)
    for v in (0.03, 0.3, 3.0):
        s.m(s.ttft).observe(v)
    sample = parse_metrics("pod-a", 10.0, s.text())
    assert (sample.running, sample.waiting, sample.kv_usage, sample.idle_fraction) == (3, 2, 0.25, 0.1)
    assert sample.generated_tokens == 1234
    assert sample.capacity_tokens_per_s == 9000.0
    assert (
        sample.ttft_buckets[0.04] == 1
        and sample.ttft_buckets[0.5] == 2
        and sample.ttft_buckets[float("inf")] == 3
    )


def test_parse_of_a_server_without_the_metrics_reports_them_missing():
    sample = parse_metrics("pod-a", 1.0, "# HELP up up\n# TYPE up gauge\nup 1\n")
    assert sample.running is None and sample.waiting is None and sample.ttft_buckets == {}


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_metrics("pod-a", 1.0, "this is { not prometheus")


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"tandem_requests_running \xff\xfe 1\n", "/metrics body is not UTF-8 text"),
        (b"this is { not prometheus", "/metrics is not Prometheus text"),
        (b"up 1\n", "does not export tandem_requests_running"),
        (b"tandem_requests_running 1\n", "does not export tandem_requests_waiting"),
        (b"tandem_requests_running +Inf\ntandem_requests_waiting 0\n", "tandem_requests_running is inf"),
        (b"tandem_requests_running 1\ntandem_requests_waiting NaN\n", "tandem_requests_waiting is nan"),
        (b"tandem_requests_running -3\ntandem_requests_waiting 0\n", "tandem_requests_running is -3"),
        (
            b"tandem_requests_running 1\ntandem_requests_waiting 0\ntandem_capacity_tokens_per_second NaN\n",
            "tandem_capacity_tokens_per_second is nan",
        ),
        (
            b"tandem_requests_running 1\ntandem_requests_waiting 0\ntandem_kv_cache_usage_ratio 1.5\n",
            "tandem_kv_cache_usage_ratio is 1.5, not within 0-1",
        ),
        (
            b"tandem_requests_running 1\ntandem_requests_waiting 0\n"
            b"# TYPE gen_ai_server_time_to_first_token_seconds histogram\n"
            b'gen_ai_server_time_to_first_token_seconds_bucket{le="1.0"} -Inf\n',
            "gen_ai_server_time_to_first_token_seconds_bucket",
        ),
    ],
)
def test_a_bad_body_is_unreadable_with_its_problem(body: bytes, problem: str):
    got = read_body("pod-a", 1.0, body)
    assert isinstance(got, Unreadable) and got.pod == "pod-a" and problem in got.problem, got


def test_a_huge_but_finite_value_is_read():
    got = read_body("pod-a", 1.0, b"tandem_requests_running 1e308\ntandem_requests_waiting 1e308\n")
    assert isinstance(got, PodSample) and got.running == 1e308  # the policy copes (test_policy_properties)


@given(st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
@settings(max_examples=300, deadline=None)
def test_any_body_gives_a_sample_or_a_reason(body: bytes):
    got = read_body("pod-a", 1.0, body)
    if isinstance(got, PodSample):  # then every value is one the policy may see
        values = [got.running, got.waiting, got.kv_usage, got.idle_fraction, got.generated_tokens]
        values.append(got.capacity_tokens_per_s)
        assert all(v is None or (math.isfinite(v) and v >= 0) for v in values)
    else:
        assert got.problem


def test_window_aggregates_pods_over_time():
    a, b = FakeServer(), FakeServer()
    history = MetricsHistory()
    for t, (ra, rb) in enumerate([(2, 4), (4, 6)]):
        a.running.set(ra)
        b.running.set(rb)
        a.waiting.set(1)
        b.waiting.set(0)
        a.idle.set(0.2)
        b.idle.set(0.4)
        a.tokens.inc(100 * (t + 1))
        b.tokens.inc(300 * (t + 1))
        for _ in range(19):
            a.ttft.observe(0.05)
        a.ttft.observe(2.0)
        history.add(
            float(t), [parse_metrics("a", float(t), a.text()), parse_metrics("b", float(t), b.text())], 60
        )
    w = history.window(cost_per_pod_hour=3.6)
    assert w.pods == 2 and w.observed_at == 1.0
    assert w.requests_running == pytest.approx((6 + 10) / 2)  # summed over pods, mean over rounds
    assert w.requests_waiting == pytest.approx(1.0)
    assert w.idle_fraction == pytest.approx(0.3)
    assert w.tokens_per_s == pytest.approx(200 + 600)  # the counters' increase over 1 s
    assert w.cost_per_mtok_usd == pytest.approx(3.6 * 2 / (800 * 3600) * 1e6)
    # the second round's 20 observations: 19 at 50 ms, one at 2 s -> p95 in the 0.04-0.06 bucket
    assert 0.04 < w.ttft_p95_s <= 0.06


def test_window_has_the_capacity_signal_and_the_load_offered():
    """Capacity: the mean of the pods that report one, times the pods (a pod whose fit is not
    ready yet counts as the others); admissions: the TTFT count's rate; the waiting slope; and
    the newest scrape interval's tokens/s beside the window's."""
    a, b = FakeServer(), FakeServer()
    history = MetricsHistory()
    for t in range(3):
        a.capacity.set(10_000.0 + 2_000.0 * t)  # b's fit has not seen enough steps: no sample
        a.waiting.set(4.0 * t)
        b.waiting.set(2.0 * t)
        a.tokens.inc(100.0 if t < 2 else 700.0)  # a burst in the newest interval
        b.tokens.inc(100.0)
        for _ in range(5 * t):
            a.ttft.observe(0.05)
        history.add(
            10.0 * t, [parse_metrics("a", 10.0 * t, a.text()), parse_metrics("b", 10.0 * t, b.text())], 60
        )
    w = history.window(cost_per_pod_hour=1.0)
    assert w.capacity_tokens_per_s == pytest.approx(2 * 12_000.0)  # mean of a's, times 2 pods
    assert w.waiting_growth_per_s == pytest.approx((12.0 - 0.0) / 20.0)
    assert w.admitted_per_s == pytest.approx((0 + 5 + 10) / 20.0)
    assert w.tokens_per_s == pytest.approx((800.0 + 200.0) / 20.0)
    assert w.recent_tokens_per_s == pytest.approx((700.0 + 100.0) / 10.0)


def test_a_pod_just_ready_is_not_yet_in_the_rates():
    """counted_pods: the pods whose counters span two scrapes of the window, which the token rate
    sums; the policy learns the load only from windows that count every pod."""
    a, b = FakeServer(), FakeServer()
    history = MetricsHistory()
    for t in range(2):
        a.tokens.inc(100.0)
        history.add(10.0 * t, [parse_metrics("a", 10.0 * t, a.text())], 60)
    b.tokens.inc(50.0)
    history.add(20.0, [parse_metrics("a", 20.0, a.text()), parse_metrics("b", 20.0, b.text())], 60)
    w = history.window(1.0)
    assert (w.pods, w.counted_pods) == (2, 1)
    history.add(30.0, [parse_metrics("a", 30.0, a.text()), parse_metrics("b", 30.0, b.text())], 60)
    assert history.window(1.0).counted_pods == 2


@pytest.mark.asyncio
async def test_a_pod_that_answers_late_is_timed_when_it_answered():
    """Over real HTTP: a pod that reads its counters late (busy, or on a loaded host) is timed when
    its answer came, so the newest interval's rate is the rate it served, not that rate stretched by
    the delay over the round's interval (which the policy would read as saturation)."""
    rate = 1000.0
    pod = MetricsPod(Addresses((9400,)).take(), 9400)
    try:
        pod.serve_rate(rate)
        history = MetricsHistory()
        async with aiohttp.ClientSession() as session:
            limit = asyncio.Semaphore(4)
            for busy_s in (0.0, 0.6):
                pod.busy_s = busy_s
                began = time.time()
                sample = await scrape_pod(session, limit, "a", metrics_url(pod.address, 9400), 5.0)
                assert isinstance(sample, PodSample)
                assert sample.time >= began + busy_s
                history.add(began, [sample], 60)
                await asyncio.sleep(0.5)
        window = history.window(1.0)
        # untimed, the second round's 1.1 s of tokens over its 0.5 s would read 2.2x the rate
        assert window.recent_tokens_per_s == pytest.approx(rate, rel=0.15)
    finally:
        pod.stop()


def test_a_window_of_pods_without_a_capacity_has_none():
    s = FakeServer()
    history = MetricsHistory()
    history.add(0.0, [parse_metrics("a", 0.0, s.text().replace("tandem_capacity", "other"))], 60)
    history.add(5.0, [parse_metrics("a", 5.0, s.text().replace("tandem_capacity", "other"))], 60)
    w = history.window(1.0)
    assert w.capacity_tokens_per_s is None and w.admitted_per_s == 0.0


def test_window_drops_old_rounds_and_survives_a_counter_reset():
    s = FakeServer()
    history = MetricsHistory()
    s.running.set(50)
    s.tokens.inc(10_000)
    history.add(0.0, [parse_metrics("a", 0.0, s.text())], window_s=10)
    fresh = FakeServer()  # the pod restarted: its counter starts again
    fresh.running.set(1)
    fresh.tokens.inc(30)
    history.add(5.0, [parse_metrics("a", 5.0, fresh.text())], window_s=10)
    assert history.window(1.0).tokens_per_s == pytest.approx(30 / 5)
    history.add(20.0, [parse_metrics("a", 20.0, fresh.text())], window_s=10)
    w = history.window(1.0)
    assert len(history.rounds) == 1 and w.requests_running == 1.0
    assert w.tokens_per_s is None and w.ttft_p95_s is None  # one scrape: no rate yet


def test_a_window_whose_pods_stopped_answering_is_observed_when_they_last_did():
    """MetricsStale needs the time of the last answer: rounds in which no pod answered must not
    make the window look fresh, nor drop that time once the answers leave the window."""
    s = FakeServer()
    history = MetricsHistory()
    history.add(0.0, [parse_metrics("a", 0.0, s.text())], window_s=10)
    for t in (5.0, 10.0, 20.0, 30.0):  # no pod answers any more
        history.add(t, [], window_s=10)
        w = history.window(1.0)
        assert w is not None and w.observed_at == 0.0
    assert w.pods == 0  # the answer itself has left the window
    assert MetricsHistory().window(1.0) is None  # never an answer


def test_window_of_a_pod_missing_a_metric_has_it_missing():
    s = FakeServer()
    history = MetricsHistory()
    history.add(0.0, [parse_metrics("a", 0.0, s.text()), parse_metrics("b", 0.0, "up 1\n")], 60)
    assert history.window(1.0).requests_running is None


def test_histogram_quantile_matches_the_observations():
    rng = random.Random(3)
    values = [rng.expovariate(4.0) for _ in range(5000)]
    cumulative = [sum(v <= le for v in values) for le in BUCKETS] + [len(values)]
    bounds = [*BUCKETS, float("inf")]
    true_p95 = sorted(values)[int(0.95 * len(values))]
    got = histogram_quantile(0.95, bounds, cumulative)
    upper = next(b for b in bounds if b >= true_p95)
    lower = max([0.0] + [b for b in bounds if b < true_p95])
    assert lower <= got <= upper  # within the bucket that holds the true p95
    assert histogram_quantile(0.95, bounds, [0] * len(bounds)) is None
    assert histogram_quantile(0.5, [1.0, float("inf")], [0, 4]) == 1.0  # all in +Inf: highest finite bound


def test_metrics_url_of_ipv4_and_ipv6_pods():
    assert metrics_url("10.1.2.3", 9400) == "http://10.1.2.3:9400/metrics"
    assert metrics_url("fd00::1a", 9400) == "http://[fd00::1a]:9400/metrics"
