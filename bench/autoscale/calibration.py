"""The simulated pod's speed and start, read from a calibration file.

A calibration file (bench/autoscale/calibration/<date>_<gpu>_<shape>.json) is built from measured
`tandem bench` results by bench/autoscale/calibrate.py; it names its GPU, date, commits and source
files. A decode step of `rows` sequences that attend `context` cached tokens in all takes

    base(rows) + kv_read_s_per_token x context

where base() interpolates the measured steps (their K/V reads taken out) between the batch sizes
measured, and the K/V term is the bytes of a cached token over the measured copy bandwidth, the
part of a step that the server's own capacity fit (service/telemetry/capacity.py) calls `context`.
Prefill runs at a measured rate of prompt tokens per second.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

CALIBRATIONS = Path(__file__).resolve().parent / "calibration"
DEFAULT = CALIBRATIONS / "2026-12-06_h100_8b.json"


@dataclass(frozen=True)
class PodModel:
    name: str  # the calibration file's stem
    gpu: str
    date: str
    # (sequences, seconds of a step with its K/V reads taken out), ascending, to interpolate
    decode_points: tuple[tuple[float, float], ...]
    kv_read_s_per_token: float
    prefill_tokens_per_s: float
    kv_capacity_tokens: float
    start_s_warm: float  # a new pod's start to serving, compile cache warm
    start_s_cold: float  # the same, compile cache empty

    @cached_property
    def _table(self) -> list[float]:
        # base() at every whole row count, so the hot loop interpolates between two list entries
        top = math.ceil(self.decode_points[-1][0]) + 1
        return [self._interp(float(r)) for r in range(top + 1)]

    def _interp(self, rows: float) -> float:
        """Piecewise linear through the points; beyond them, the nearest segment extended."""
        pts = self.decode_points
        if len(pts) == 1:
            return pts[0][1]
        i = 1
        while i < len(pts) - 1 and rows > pts[i][0]:
            i += 1
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def base_s(self, rows: float) -> float:
        table = self._table
        i = int(rows)
        if i >= len(table) - 1:
            return self._interp(rows)
        return table[i] + (table[i + 1] - table[i]) * (rows - i)

    def step_s(self, rows: float, context: float) -> float:
        """One decode step of `rows` sequences attending `context` cached tokens in all."""
        return self.base_s(rows) + self.kv_read_s_per_token * context

    def decode_steps(self, seconds: float, rows: float, context: float) -> float:
        """How many decode steps fit in `seconds` while each step adds `rows` tokens to the context:
        n x (step_s(rows, context) + kv x rows x n / 2) = seconds, solved for n."""
        b = self.step_s(rows, context)
        a = self.kv_read_s_per_token * rows / 2
        return 2 * seconds / (b + math.sqrt(b * b + 4 * a * seconds))

    def capacity_tokens_per_s(
        self, context_per_row: float, prefill_per_token: float, max_num_seqs: int
    ) -> float:
        """Generated tokens per second at the largest batch a pod holds at this mix, as the server's
        `tandem_capacity_tokens_per_second` defines it (service/telemetry/capacity.py): as many rows
        as max_num_seqs and the KV cache allow at this context, each generated token with its share
        of prefill. The simulation knows its pods' step time exactly; the server fits it."""
        rows = float(max_num_seqs)
        if context_per_row > 0:
            rows = max(1.0, min(rows, self.kv_capacity_tokens / context_per_row))
        step = self.step_s(rows, rows * context_per_row)
        return 1.0 / (step / rows + prefill_per_token / self.prefill_tokens_per_s)


def read(path: str | Path) -> dict:
    """A calibration file's whole record (for the report)."""
    return json.loads(Path(path).read_text())


def pod_model(record: dict, name: str) -> PodModel:
    decode = record["decode_step"]
    return PodModel(
        name=name,
        gpu=record["gpu"],
        date=record["date"],
        decode_points=tuple((float(b), float(s)) for b, s in decode["points"]),
        kv_read_s_per_token=float(decode["kv_read_s_per_token"]),
        prefill_tokens_per_s=float(record["prefill"]["tokens_per_s"]),
        kv_capacity_tokens=float(record["kv_cache"]["tokens"]),
        start_s_warm=float(record["start"]["warm_cache_s"]),
        start_s_cold=float(record["start"]["cold_cache_s"]),
    )


@cache
def load(path: str | Path = DEFAULT) -> PodModel:
    path = Path(path)
    return pod_model(read(path), path.stem)
