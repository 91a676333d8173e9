"""Tokens generated over a sliding window, and what they cost per million at a price per GPU-hour."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class TokenWindow:
    """Generated tokens with their arrival times; counts those of the last `window_s` seconds.

    Tokens arriving within `window_s / 1000` of the previous entry join it, so memory stays bounded
    (about a thousand entries) however many tokens a second the server makes.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._resolution = window_s / 1000
        self._events: deque[list] = deque()  # [time of the first token, tokens], oldest first
        self._total = 0  # tokens in `_events`
        self._lock = threading.Lock()

    def add(self, tokens: int, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            if self._events and now - self._events[-1][0] < self._resolution:
                self._events[-1][1] += tokens
            else:
                self._events.append([now, tokens])
            self._total += tokens
            self._trim(now)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0][0] <= horizon:
            self._total -= self._events.popleft()[1]

    def tokens(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        with self._lock:
            self._trim(now)
            return self._total

    def tokens_per_hour(self, now: float | None = None) -> float:
        return self.tokens(now) * 3600.0 / self.window_s


def cost_per_million_tokens(price_per_gpu_hour: float, num_gpus: int, tokens_per_hour: float) -> float | None:
    """USD per million generated tokens; None (no value) when GPUs cost money and produced nothing.

    Infinity would be the honest number, but OpenTelemetry drops non-finite measurements, so the
    metric is absent instead, as any unknown value is.
    """
    spend = price_per_gpu_hour * num_gpus  # USD per hour
    if spend == 0:
        return 0.0
    if tokens_per_hour <= 0:
        return None
    return spend / tokens_per_hour * 1e6
