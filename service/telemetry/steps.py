
"""Engine-step spans and stage durations: what one step spent in each stage of the step loop.

The engine hands a `StepTiming` to its `step_observer` once per finished step and its process
reports them to the supervisor, which records them here. On CPU the stages come from host clocks;
on CUDA the h2d/compute/d2h bounds come from stream events, converted to wall clock without extra
synchronisation.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Histogram

from ..contract import Interval, StepTiming

log = logging.getLogger(__name__)

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
        # telemetry must never take the pod down with it
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
