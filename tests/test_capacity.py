"""The spare-capacity signal: a pod's step-time fit and what it says the pod could do at its mix."""

from __future__ import annotations

import math
import random

import pytest

from tandem.service.telemetry.capacity import MIN_STEPS, CapacityModel

# a step law of the kind an 8B decode on one GPU follows (seconds)
FIXED, PER_ROW, PER_CONTEXT, PER_PREFILL = 4e-3, 6e-6, 2.5e-8, 4e-6


def law(rows: int, context: int, prefill: int) -> float:
    return FIXED + PER_ROW * rows + PER_CONTEXT * context + PER_PREFILL * prefill


def feed(
    model: CapacityModel, steps: int, max_rows: int, seq_len: int, prefill_every: int | None, noise: float
) -> None:
    rng = random.Random(0)
    for i in range(steps):
        rows = rng.randint(1, max_rows)
        prefill = 512 if prefill_every and i % prefill_every == prefill_every - 1 else 0
        context = rows * seq_len + prefill
        model.observe(rows, context, prefill, law(rows, context, prefill) * (1 + rng.gauss(0, noise)))


def test_capacity_at_the_largest_batch_from_steps_at_smaller_ones() -> None:
    """Fitted on batches of at most 64 rows, it predicts the step at 256 from the law's parts."""
    model = CapacityModel(max_num_seqs=256, kv_tokens=10**7)
    feed(model, 3000, max_rows=64, seq_len=600, prefill_every=10, noise=0.02)
    capacity, rows = model.capacity()
    context_per_token, prefill_per_token = model.mix()
    expected = rows / law(rows, rows * context_per_token, rows * prefill_per_token)
    assert rows == 256
    assert capacity == pytest.approx(expected, rel=0.05)
    assert model.utilization(capacity / 4) == pytest.approx(0.25)


def test_the_kv_cache_bounds_the_batch() -> None:
    """At 600 tokens per row, 60,000 tokens of KV cache hold 100 rows, not max_num_seqs' 256."""
    model = CapacityModel(max_num_seqs=256, kv_tokens=60_000)
    feed(model, 2000, max_rows=64, seq_len=600, prefill_every=None, noise=0.0)
    _, rows = model.capacity()
    assert rows == 100


def test_nothing_is_said_before_enough_steps_and_bad_times_are_ignored() -> None:
    model = CapacityModel(max_num_seqs=8, kv_tokens=10**6)
    assert model.capacity() is None and model.utilization(10.0) is None
    for _ in range(MIN_STEPS - 1):
        model.observe(4, 400, 0, law(4, 400, 0))
    for bad in (math.nan, math.inf, -1.0, 0.0):
        model.observe(4, 400, 0, bad)
    model.observe(0, 0, 0, 0.01)  # an empty step
    assert model.capacity() is None
    model.observe(4, 400, 0, law(4, 400, 0))
    assert model.capacity() is not None


def test_a_fit_from_one_batch_size_never_predicts_a_step_faster_than_any_seen() -> None:
    """Steps of one shape leave the parts undetermined: the prediction keeps to what was measured."""
    model = CapacityModel(max_num_seqs=256, kv_tokens=10**7)
    for _ in range(500):
        model.observe(8, 8 * 300, 0, law(8, 8 * 300, 0))
    seconds = model.step_seconds(256, 256 * 300, 0)
    assert seconds >= law(8, 8 * 300, 0) * 0.999


def test_steady_concurrency_gives_the_fixed_part_its_time() -> None:
    """Every step at 32 rows: the data cannot tell the fixed part from the per-row part; the ridge
    gives the time to the fixed part, so the prediction at 256 rows misses only the per-row part."""
    model = CapacityModel(max_num_seqs=256, kv_tokens=10**7)
    rng = random.Random(1)
    for _ in range(3000):
        seq_len = rng.randint(128, 384)
        model.observe(32, 32 * seq_len, 0, law(32, 32 * seq_len, 0))
    capacity, rows = model.capacity()
    context_per_token, _ = model.mix()
    expected = rows / law(rows, rows * context_per_token, 0)
    assert rows == 256
    assert expected < capacity < 1.3 * expected  # a little optimistic: 256 rows' own work is unseen
