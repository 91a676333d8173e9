"""A day of LLM traffic: diurnal arrival rate, bursts, minute-scale noise, request sizes.

Arrivals are Poisson per second. Each second's requests are split into four equal cohorts whose
prompt and output lengths are the quartile midpoints of log-normal distributions: the sizes keep
their spread while the simulator moves four cohorts a second instead of every request.

SHAPES are the three kinds of traffic the comparison runs, each with the same diurnal shape and
bursts; their rates were scaled to what one pod of an uncalibrated H200 pod model served within the
TTFT SLO at each token mix (about 22, 12 and 10 requests/s). The calibrated H100 pods carry about
34, 17 and 17 requests/s at capacity (docs/autoscaling.md), so the same day needs fewer of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

QUANTILES = (0.125, 0.375, 0.625, 0.875)
# Output quartiles paired with prompt quartiles in this order, so long prompts do not always
# come with long answers.
OUTPUT_ORDER = (2, 0, 3, 1)


@dataclass(frozen=True)
class TraceConfig:
    hours: float = 24.0
    trough_rps: float = 12.0  # requests per second at 04:00
    peak_rps: float = 150.0  # at peak_hour, before bursts
    peak_hour: float = 14.0
    bursts_per_day: float = 8.0
    burst_factor: tuple[float, float] = (1.5, 2.2)  # rate multiplier during a burst
    burst_minutes: tuple[float, float] = (4.0, 20.0)
    burst_ramp_s: float = 60.0
    noise: float = 0.08  # minute-scale multiplicative noise (AR(1), this standard deviation)
    prompt_median: float = 450.0
    prompt_sigma: float = 0.8
    output_median: float = 200.0
    output_sigma: float = 0.7
    seed: int = 7


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    rate: np.ndarray  # expected requests per second, per second of the trace
    counts: np.ndarray  # requests arriving in each second
    prompt_tokens: tuple[float, ...]  # per cohort
    output_tokens: tuple[float, ...]  # per cohort

    @property
    def seconds(self) -> int:
        return len(self.counts)


def _lognormal_quantile(median: float, sigma: float, q: float) -> float:
    from statistics import NormalDist

    return median * math.exp(sigma * NormalDist().inv_cdf(q))


def arrival_rate(cfg: TraceConfig, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(int(cfg.hours * 3600), dtype=np.float64)
    hour = (t / 3600.0) % 24.0
    # 0 at peak_hour - 12 h, 1 at peak_hour; the power makes the night long and the peak narrow
    shape = ((1 + np.cos(2 * np.pi * (hour - cfg.peak_hour) / 24.0)) / 2) ** 1.5
    rate = cfg.trough_rps + (cfg.peak_rps - cfg.trough_rps) * shape

    minutes = len(t) // 60 + 1
    ar = np.zeros(minutes)
    for m in range(1, minutes):
        ar[m] = 0.8 * ar[m - 1] + rng.normal(0, cfg.noise * math.sqrt(1 - 0.8**2))
    rate *= 1 + np.interp(t / 60.0, np.arange(minutes), ar)

    n_bursts = rng.poisson(cfg.bursts_per_day * cfg.hours / 24.0)
    for _ in range(n_bursts):
        start = rng.uniform(0, len(t))
        length = 60.0 * rng.uniform(*cfg.burst_minutes)
        factor = rng.uniform(*cfg.burst_factor)
        # trapezoid: ramp up, hold, ramp down
        up = np.clip((t - start) / cfg.burst_ramp_s, 0, 1)
        down = np.clip((start + length - t) / cfg.burst_ramp_s, 0, 1)
        rate *= 1 + (factor - 1) * np.minimum(up, down)
    return np.maximum(rate, 0.0)


def make_trace(cfg: TraceConfig) -> Trace:
    rng = np.random.default_rng(cfg.seed)
    rate = arrival_rate(cfg, rng)
    counts = rng.poisson(rate).astype(np.float64)
    prompts = tuple(_lognormal_quantile(cfg.prompt_median, cfg.prompt_sigma, q) for q in QUANTILES)
    outputs = [_lognormal_quantile(cfg.output_median, cfg.output_sigma, q) for q in QUANTILES]
    return Trace(cfg, rate, counts, prompts, tuple(outputs[i] for i in OUTPUT_ORDER))


SHAPES: dict[str, TraceConfig] = {
    # the chat mix: prompts of 450 tokens (median), answers of 200
    "chat": TraceConfig(),
    # short prompts, long answers: decode-bound
    "decode_heavy": TraceConfig(
        trough_rps=7.0,
        peak_rps=85.0,
        prompt_median=100.0,
        prompt_sigma=0.6,
        output_median=800.0,
        output_sigma=0.6,
    ),
    # 2,000-token prompts, 40-token answers (RAG, classification): prefill-bound
    "prefill_heavy": TraceConfig(
        trough_rps=5.0,
        peak_rps=65.0,
        prompt_median=2000.0,
        prompt_sigma=0.3,
        output_median=40.0,
        output_sigma=0.3,
    ),
}


def shape(name: str, hours: float, seed: int) -> TraceConfig:
    return replace(SHAPES[name], hours=hours, seed=seed)
