"""Engine-step telemetry in the GPU benchmark: the stage timeline, and what tracing costs.

Both attach to an engine core's `step_observer`, the hook the server's telemetry uses: each
finished step hands over a StepTiming (prepare on the host clock; h2d, compute and d2h from the
step's CUDA events on GPU).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.bench.engine.harness import RunStats, run_tandem
from tandem.bench.engine.timeline import trace_events
from tandem.service.engine.engine_core import EngineCore


def record_timeline(cores: dict[str, EngineCore], prompts: Sequence[list[int]], new: int, out: Path) -> dict:
    """Run each core once more with a recording observer; write the Chrome/Perfetto trace JSON."""
    events = []
    summary = {}
    for name, core in cores.items():
        steps: list[dict] = []

        def keep(timing: object, steps: list[dict] = steps) -> None:
            steps.append({"index": len(steps), **dict(timing.stages()),
                          "args": {"batch_size": timing.batch_size, "graph_bucket": timing.graph_bucket,
                                   "slot": timing.slot}})

        core.step_observer = keep
        try:
            run_tandem(core, prompts, new, tag=f"t{name}")
        finally:
            core.step_observer = None
        events += trace_events(name, steps)
        summary[name] = {"steps": len(steps)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return summary


def tracing_overhead_runs(core: EngineCore, prompts: Sequence[list[int]], new: int
                          ) -> dict[str, Callable[[], RunStats]]:
    """The same core with tracing off, step spans sampled at 1% and at 100%.

    A real OpenTelemetry SDK pipeline: a TracerProvider with a BatchSpanProcessor (its exporter
    discards the batches: no collector here) and the step-duration histogram on a MeterProvider.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from tandem.service.telemetry.steps import StepRecorder

    class Discard(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(Discard()))
    meter = MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench")
    histogram = meter.create_histogram("tandem_step_duration_seconds", unit="s")
    tracer = tracer_provider.get_tracer("bench")

    def with_observer(rate: float | None, tag: str) -> Callable[[], RunStats]:
        def run() -> RunStats:
            core.step_observer = None if rate is None else StepRecorder(tracer, histogram, rate)
            try:
                return run_tandem(core, prompts, new, tag=tag)
            finally:
                core.step_observer = None

        return run

    return {"tracing_off": with_observer(None, "off"), "steps_traced_1pct": with_observer(0.01, "p1"),
            "steps_traced_100pct": with_observer(1.0, "p100")}
