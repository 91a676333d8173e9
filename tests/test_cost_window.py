"""Tokens over a sliding window and the cost per million tokens derived from them."""

from __future__ import annotations

import pytest

from tandem.service.telemetry.cost import TokenWindow, cost_per_million_tokens


def test_tokens_slide_out_of_the_window():
    w = TokenWindow(window_s=10.0)
    w.add(100, now=1.0)
    w.add(50, now=6.0)
    assert w.tokens(now=10.0) == 150
    assert w.tokens(now=11.5) == 50  # the first batch is more than 10 s old
    assert w.tokens_per_hour(now=11.5) == pytest.approx(50 * 360)
    assert w.tokens(now=30.0) == 0


def test_memory_stays_bounded_under_many_small_additions():
    w = TokenWindow(window_s=10.0)
    for i in range(100_000):  # one token every 0.1 ms for 10 s
        w.add(1, now=(i + 1) * 1e-4)
    assert w.tokens(now=10.0) == 100_000
    assert len(w._events) <= 1001


def test_cost_is_price_times_gpus_over_tokens_per_hour():
    # 2 GPUs at $3/h making 1,000 tokens/s = 3.6M tokens/h: $6 / 3.6M tokens = $1.67 per million
    assert cost_per_million_tokens(3.0, 2, 3.6e6) == pytest.approx(6 / 3.6)
    assert cost_per_million_tokens(0.0, 8, 0.0) == 0.0  # no price configured: free
    assert cost_per_million_tokens(3.0, 1, 0.0) is None  # paid for, nothing made: no finite value
