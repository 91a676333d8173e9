"""Where a slow step spends its time: the main thread's stack, sampled only while a step runs long.

A timed run that loses a second to one step says nothing of why from its counters alone (a garbage
collection, a compile, a page-locked allocation, a lock). The bench loops run each step through
`STEPS.watched` (two attribute writes around it); while one runs past `after_s`,
a daemon thread samples the main thread's innermost frames every `every_s`. Fast steps are never
sampled, so the timed run is not slowed: the thread only wakes, reads a float and sleeps.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class SlowStepStacks:
    def __init__(self, after_s: float = 0.1, every_s: float = 0.01, depth: int = 8) -> None:
        self.after_s, self.every_s, self.depth = after_s, every_s, depth
        self._began = 0.0  # perf_counter at the running step's start; 0.0 between steps
        self._stacks: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident

    def began(self) -> None:
        self._began = time.perf_counter()

    def ended(self) -> None:
        self._began = 0.0

    def watched(self, step: Callable[[], T]) -> T:
        """Run one step, marked as running for the sampler."""
        self.began()
        try:
            return step()
        finally:
            self.ended()

    def start(self) -> None:
        self._stacks.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="slow-step-stacks", daemon=True)
        self._thread.start()

    def stop(self) -> list[dict]:
        """The sampled stacks, most seen first: each with the seconds it was seen for."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._began = 0.0
        seen = self._stacks.most_common(5)
        return [{"seconds": round(n * self.every_s, 3), "stack": stack} for stack, n in seen]

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            began = self._began
            if began and time.perf_counter() - began > self.after_s:
                frame = sys._current_frames().get(self._main)
                if frame is not None:
                    self._stacks[self._summary(frame)] += 1

    def _summary(self, frame: object) -> str:
        """The innermost frames as `file:line function`, innermost first, each called from the next."""
        parts = []
        while frame is not None and len(parts) < self.depth:
            code = frame.f_code
            parts.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return " < ".join(parts)


STEPS = SlowStepStacks()  # the one the bench loops mark and StallWatch reads
