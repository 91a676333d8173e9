"""The engine process's Python garbage collector: the start-up heap frozen, every collection timed.

CPython's cyclic collector stops the thread that triggers it while it walks a generation's tracked
objects; a full (generation 2) collection walks all of them. Once the model is compiled and its
graphs captured the process holds millions (Dynamo's guards and graphs, Inductor's code, sympy
expressions), and a full collection in the middle of serving holds up the step loop for as long as
the walk takes (docs/benchmarks.md). Those objects live as long as the engine, so after start-up
they move to the collector's permanent generation, which no collection walks (vLLM and SGLang do
the same); objects made while serving are collected as before, and their pauses are counted so
that a stall the collector causes shows on the dashboard.
"""

from __future__ import annotations

import gc
import time

from ..contract import GC_GENERATIONS as GENERATIONS
from ..contract import GcTotals


def freeze_start_up_heap() -> int:
    """Collect once (garbage of the start-up goes), then freeze every object alive -> objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Times each collection of this process through `gc.callbacks` (installed while in use).
    `frozen_objects`: what freeze_start_up_heap returned (gc.get_freeze_count() walks the whole
    permanent generation, too slow to ask at every report)."""

    def __init__(self, frozen_objects: int = 0) -> None:
        self.collections = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self.frozen_objects = frozen_objects
        self._began = 0.0

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._began

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_collection)

    def totals(self) -> GcTotals:
        return GcTotals(tuple(self.collections), tuple(self.seconds), self.frozen_objects)
