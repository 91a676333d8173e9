"""Engine-step spans and stage durations: what one step spent in each stage of the step loop.

The engine hands a `StepTiming` to its `step_observer` once per finished step. On CPU the stages
come from host clocks; on CUDA the h2d/compute/d2h bounds are meant to come from stream events,
converted to wall clock without extra synchronisation.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Histogram

log = logging.getLogger(__name__)

STAGES = ("prepare", "h2d", "compute", "d2h")
Interval = tuple[float, float]  # (start, end), wall clock: time.time() seconds


@dataclass(frozen=True)
class StepTiming:
    """One finished engine step. A stage that did not run on its own (e.g. h2d on CPU) is None."""

    prepare: Interval | None = None  # CPU: scheduling and batch building
    h2d: Interval | None = None
    compute: Interval | None = None  # forward + sample
    d2h: Interval | None = None
    batch_size: int = 0  # sequences in the step
    num_tokens: int = 0  # tokens computed (prefill chunks + decodes)
    slot: int | None = None  # input slot of the asynchronous loop
    graph_bucket: int | None = None  # CUDA-graph batch-size bucket replayed, None = eager

    def stages(self) -> Iterator[tuple[str, Interval]]:
        for name in STAGES:
            interval = getattr(self, name)
            if interval is not None:
                yield name, interval

    @property
    def bounds(self) -> Interval | None:
        intervals = [i for _, i in self.stages()]
        if not intervals:
            return None
        return min(s for s, _ in intervals), max(e for _, e in intervals)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class StepRecorder:
    """Observes every step's stage durations; traces a sampled share of steps as `step` spans."""

    def __init__(
        self,
        tracer: trace.Tracer,
        duration: Histogram,
        sample_rate: float,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.tracer = tracer
        self.duration = duration
        self.sample_rate = sample_rate
        self.draw = draw
        self._failed = False

    def __call__(self, timing: StepTiming) -> None:
        # runs on the engine thread: telemetry must never take a step down with it
        try:
            self._record(timing)
        except Exception:
            if not self._failed:
                log.exception("recording an engine step failed; later failures are not logged")
                self._failed = True

    def _record(self, timing: StepTiming) -> None:
        bounds = timing.bounds
        if bounds is None:
            return
        for name, (start, end) in timing.stages():
            self.duration.record(end - start, {"stage": name})
        self.duration.record(bounds[1] - bounds[0], {"stage": "step"})
        if self.sample_rate > 0 and self.draw() < self.sample_rate:
            self._span(timing, bounds)

    def _span(self, timing: StepTiming, bounds: Interval) -> None:
        attributes = {
            "tandem.step.batch_size": timing.batch_size,
            "tandem.step.num_tokens": timing.num_tokens,
        }
        if timing.slot is not None:
            attributes["tandem.step.slot"] = timing.slot
        if timing.graph_bucket is not None:
            attributes["tandem.step.graph_bucket"] = timing.graph_bucket
        # a step serves many requests: its own trace, never a child of whatever is current
        step = self.tracer.start_span(
            "step", context=Context(), start_time=_ns(bounds[0]), attributes=attributes
        )
        parent = trace.set_span_in_context(step)
        for name, (start, end) in timing.stages():
            self.tracer.start_span(name, context=parent, start_time=_ns(start)).end(end_time=_ns(end))
        step.end(end_time=_ns(bounds[1]))
