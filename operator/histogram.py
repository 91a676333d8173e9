"""Quantiles from cumulative histogram buckets, as Prometheus' histogram_quantile() computes them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def histogram_quantile(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float | None:
    """The q-quantile of observations counted in cumulative buckets (`le` bounds, the last +Inf).

    Linear interpolation inside the bucket that holds the quantile; the lowest bucket starts at 0;
    a quantile in the +Inf bucket is the highest finite bound. None when nothing was observed.
    """
    total = float(cumulative[-1]) if len(cumulative) else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, cumulative, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
