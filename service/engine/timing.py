"""The share of a window the device spent idle, from the busy intervals of the engine's steps (each
step's own timing, `StepTiming`, is a record of the contract: it goes to the supervisor's telemetry).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ..contract import Interval


class IdleTracker:
    """Share of the last `window_s` seconds with no step in flight, from the steps' busy intervals.

    The busy time of the window is kept as a running sum, so a reading costs only the intervals
    that straddle the window's edges, however many steps a second the engine runs.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._busy: deque[Interval] = deque()  # (start, end) of steps, oldest first
        self._total = 0.0  # sum of the lengths in `_busy`
        self._lock = threading.Lock()

    def record(self, start: float, end: float) -> None:
        with self._lock:
            self._busy.append((start, end))
            self._total += end - start
            self._trim(end)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._busy and self._busy[0][1] <= horizon:
            start, end = self._busy.popleft()
            self._total -= end - start

    def idle_fraction(self, now: float | None = None) -> float:
        """1.0 = nothing ran in the window."""
        now = self.clock() if now is None else now
        horizon = now - self.window_s
        with self._lock:
            self._trim(now)
            busy = self._total
            for start, _end in self._busy:  # the oldest ones may begin before the window
                if start >= horizon:
                    break
                busy -= horizon - start
            for start, end in reversed(self._busy):  # a reading in the past: steps after `now`
                if end <= now:
                    break
                busy -= end - max(start, now)
        return min(1.0, max(0.0, 1.0 - busy / self.window_s))
