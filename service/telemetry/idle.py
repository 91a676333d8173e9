"""Idle fraction of the device over a sliding window, from the intervals a step was in flight.

The synchronous loop times steps on the host clock; the asynchronous CUDA loop will feed the
same tracker from compute-stream event timestamps.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class IdleTracker:
    def __init__(self, window_s: float = 60.0, clock: object = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._busy: deque[tuple[float, float]] = deque()  # (start, end) of steps, oldest first
        self._lock = threading.Lock()

    def record(self, start: float, end: float) -> None:
        with self._lock:
            self._busy.append((start, end))
            self._trim(end)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._busy and self._busy[0][1] <= horizon:
            self._busy.popleft()

    def idle_fraction(self, now: float | None = None) -> float:
        """Share of the last `window_s` seconds with no step in flight (1.0 = nothing ran)."""
        now = self.clock() if now is None else now
        horizon = now - self.window_s
        with self._lock:
            self._trim(now)
            busy = sum(min(e, now) - max(s, horizon) for s, e in self._busy if e > horizon)
        return max(0.0, 1.0 - busy / self.window_s)
