"""How much of its capacity a pod's traffic uses: the spare-capacity signal the autoscaler reads.

An engine step's device time is close to linear in what the step does: a fixed part (the weights
read once per step, launches), a part per row (sampling, per-sequence work), a part per context
token attended (the KV cache that decode attention reads) and a part per prefill token (its GEMMs).
The pod fits `seconds = a + b*rows + c*context + d*prefill` to its own steps (least squares over
sums that forget old steps, with a light ridge on the per-row and per-prefill parts), and from the
current traffic's mix (context attended and prefill tokens per generated token, over the same
memory) asks what a step at the largest batch the pod can hold would take: as many rows as
`max_num_seqs` and the KV cache allow at that context.
capacity = rows / seconds generated tokens per second; utilization = achieved / capacity.

Unlike the idle fraction, which reads near zero whenever anything runs (the engine steps on), this
says how far the batch could still grow before the device is the limit.
"""

from __future__ import annotations

import math
import threading

import numpy as np

# features scaled near 1 at a full step, so that one ridge suits every model
SCALE = np.array([1.0, 1 / 256, 1 / 262_144, 1 / 2048])
FORGET = 0.999  # per step: the fit remembers about the last thousand steps
MIN_STEPS = 32  # before this many steps the fit says nothing
# Traffic at a steady concurrency runs every step at about the same rows, so the fixed part and the
# per-row part cannot be told apart from the data; the ridge then gives the time to the fixed part,
# as on a GPU, where a decode step reads the weights whatever its batch. Steps of varied rows (real
# traffic) outweigh it at once: it weighs as much as a few steps against the fit's thousand.
RIDGE = np.diag([0.0, 1.0, 0.0, 1.0])


class CapacityModel:
    def __init__(self, max_num_seqs: int, kv_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.kv_tokens = kv_tokens  # KV-cache capacity in tokens (blocks x block size)
        self._xx = np.zeros((4, 4))  # forgotten sums of x x^T and x * seconds
        self._xy = np.zeros(4)
        self._steps = 0
        self._min_seconds = math.inf
        # exponentially forgotten sums, for the traffic's mix
        self._rows = self._context = self._prefill = 0.0
        self._lock = threading.Lock()

    def observe(self, rows: int, context: int, prefill: int, seconds: float) -> None:
        """One finished step: its rows, positions attended, prefill tokens and device seconds."""
        if rows <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        x = np.array([1.0, rows, context, prefill]) * SCALE
        with self._lock:
            self._xx = FORGET * self._xx + np.outer(x, x)
            self._xy = FORGET * self._xy + x * seconds
            self._steps += 1
            self._min_seconds = min(self._min_seconds, seconds)
            decodes = rows - (1 if prefill else 0)  # a prefill chunk's row is not a decode
            self._rows = FORGET * self._rows + max(decodes, 0)
            self._context = FORGET * self._context + context
            self._prefill = FORGET * self._prefill + prefill

    def step_seconds(self, rows: float, context: float, prefill: float) -> float | None:
        """The fitted time of a step; None before the fit has seen enough steps."""
        with self._lock:
            if self._steps < MIN_STEPS:
                return None
            theta = np.linalg.lstsq(self._xx + RIDGE, self._xy, rcond=None)[0]
            floor = self._min_seconds
        coef = np.maximum(theta, 0.0)  # no part of a step takes negative time
        x = np.array([1.0, rows, context, prefill]) * SCALE
        return max(float(x @ coef), floor)

    def mix(self) -> tuple[float, float] | None:
        """(mean context per row, prefill tokens per generated token) of the recent traffic."""
        with self._lock:
            if self._rows <= 0:
                return None
            return self._context / max(self._rows, 1.0), self._prefill / self._rows

    def capacity(self) -> tuple[float, int] | None:
        """(generated tokens per second at the largest batch the pod can hold, that batch)."""
        mix = self.mix()
        if mix is None:
            return None
        context_per_row, prefill_per_token = mix
        rows = self.max_num_seqs
        if context_per_row > 0:
            rows = max(1, min(rows, int(self.kv_tokens / context_per_row + 1e-6)))
        seconds = self.step_seconds(rows, rows * context_per_row, rows * prefill_per_token)
        if seconds is None:
            return None
        return rows / seconds, rows

    def utilization(self, achieved_tokens_per_s: float) -> float | None:
        capacity = self.capacity()
        if capacity is None:
            return None
        return achieved_tokens_per_s / capacity[0]
