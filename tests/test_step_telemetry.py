"""Engine-step telemetry: the core's step observer on a real engine, and the step recorder on the
real OpenTelemetry SDK (in-memory span exporter and metric reader)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_config
from engine_harness import Arrival, make_core, run
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams, StepTiming
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.telemetry.cost import TokenWindow
from tandem.service.telemetry.metrics import STEP_DURATION_BUCKETS, ServerMetrics
from tandem.service.telemetry.steps import StepRecorder


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_tiny_config("llama", 128)).eval()


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_the_core_reports_every_step_once_with_host_clock_stages(tiny_model, loop: str):
    core = make_core(tiny_model, step_loop=loop, max_num_batched_tokens=16)
    seen: list[StepTiming] = []
    core.step_observer = seen.append
    prompts = {"a": 21, "b": 5, "c": 9}  # a's prompt takes two 16-token steps: chunked prefill
    arrivals = [
        Arrival(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=6), at_step=i)
        for i, (rid, n) in enumerate(prompts.items())
    ]
    result = run(core, arrivals)
    assert len(seen) == core.steps > 0
    for t in seen:
        assert t.h2d is None and t.d2h is None  # no separate copies on CPU
        assert t.prepare[0] <= t.prepare[1] <= t.compute[0] <= t.compute[1]
        assert 1 <= t.batch_size <= t.num_tokens <= 16
        assert t.slot in (0, 1) and t.graph_bucket is None  # no CUDA graphs on CPU
    # every prompt token is computed once, then each generated token but the last is fed back
    fed_back = sum(len(tokens) - 1 for tokens in result.tokens.values())
    if loop == "sync":
        assert sum(t.num_tokens for t in seen) == sum(prompts.values()) + fed_back
    assert all(seen[i].bounds[0] <= seen[i + 1].bounds[0] for i in range(len(seen) - 1))



def test_the_observer_given_to_build_core_sees_every_step(tiny_model):
    seen: list[StepTiming] = []
    config = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, step_loop="sync")
    core = build_core(tiny_model, config, step_observer=seen.append)
    result = run(core, [Arrival("a", list(range(3, 12)), SamplingParams(max_tokens=4))])
    assert len(result.tokens["a"]) == 4
    assert len(seen) == core.steps == 4  # the prompt's step, then one per fed-back token

def _recorder(sample_rate: float, draws: list[float] | None = None):
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    metrics = ServerMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), TokenWindow(60), 0.0, 1)
    draw = iter(draws or []).__next__
    recorder = StepRecorder(tracer_provider.get_tracer("t"), metrics.step_duration, sample_rate, draw)
    return recorder, spans, reader


def _step_histogram(reader: InMemoryMetricReader) -> dict[str, object]:
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "tandem_step_duration_seconds":
                    return {dict(p.attributes)["stage"]: p for p in m.data.data_points}
    return {}


T0 = 1_700_000_000.0
TIMING = StepTiming(
    prepare=(T0, T0 + 0.001),
    h2d=(T0 + 0.001, T0 + 0.0015),
    compute=(T0 + 0.0015, T0 + 0.0095),
    d2h=(T0 + 0.0095, T0 + 0.01),
    batch_size=4,
    num_tokens=19,
    slot=1,
    graph_bucket=4,
)


def test_a_sampled_step_is_a_span_with_its_stages_as_children():
    recorder, spans, reader = _recorder(1.0, [0.5])
    recorder(TIMING)
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"step", "prepare", "h2d", "compute", "d2h"}
    step = by_name["step"]
    assert step.parent is None
    assert (step.start_time, step.end_time) == (int(T0 * 1e9), int((T0 + 0.01) * 1e9))
    assert dict(step.attributes) == {
        "tandem.step.batch_size": 4,
        "tandem.step.num_tokens": 19,
        "tandem.step.slot": 1,
        "tandem.step.graph_bucket": 4,
    }
    for stage in ("prepare", "h2d", "compute", "d2h"):
        span, (start, end) = by_name[stage], getattr(TIMING, stage)
        assert span.parent.span_id == step.context.span_id
        assert span.context.trace_id == step.context.trace_id
        assert (span.start_time, span.end_time) == (int(start * 1e9), int(end * 1e9))
    points = _step_histogram(reader)
    assert set(points) == {"prepare", "h2d", "compute", "d2h", "step"}
    assert points["compute"].sum == pytest.approx(0.008, abs=1e-6)  # wall-clock floats
    assert points["step"].sum == pytest.approx(0.01, abs=1e-6)
    assert tuple(points["step"].explicit_bounds) == STEP_DURATION_BUCKETS


def test_only_the_sampled_share_of_steps_is_traced_but_every_step_is_measured():
    recorder, spans, reader = _recorder(0.25, [0.1, 0.3, 0.9, 0.2, 0.26])
    for _ in range(5):
        recorder(TIMING)
    assert [s.name for s in spans.get_finished_spans()].count("step") == 2  # draws 0.1 and 0.2
    assert all(p.count == 5 for p in _step_histogram(reader).values())


def test_sample_rate_zero_never_traces_and_a_step_without_stages_is_ignored():
    recorder, spans, reader = _recorder(0.0)
    recorder(TIMING)
    recorder(StepTiming(batch_size=1))
    assert spans.get_finished_spans() == ()
    assert _step_histogram(reader)["step"].count == 1


def test_a_failing_recorder_does_not_raise_into_the_engine():
    recorder, spans, _ = _recorder(1.0, [])  # the draw raises StopIteration: the recording fails
    recorder(TIMING)
    recorder(TIMING)
    assert spans.get_finished_spans() == ()
