"""The pod's metrics, kept by the supervisor from what the engine and the fronts report.

The engine reports each step (stage timings, tokens generated, its load right after the step) and,
when idle, its load every so often; each front reports every request it finished. From these come
the one /metrics endpoint of the pod (and the OTLP metrics), however many fronts there are, the
sampled `step` spans, and the model statistics a front answers KServe's ModelStatistics with.
"""

from __future__ import annotations

from opentelemetry import trace

from .. import contract as c
from ..contract import EngineStats, GcTotals, ModelInfo, StepTiming
from ..settings import ServerSettings
from .capacity import CapacityModel
from .cost import TokenWindow
from .metrics import ServerMetrics
from .model_statistics import ModelStatistics
from .otel import SCOPE, meter_provider, tracer_provider
from .startup import StartupClock
from .steps import StepRecorder


class PodTelemetry:
    def __init__(self, settings: ServerSettings) -> None:
        self.meter_provider = meter_provider(settings)
        self.tracer_provider = tracer_provider(settings)
        tracer = self.tracer_provider.get_tracer(SCOPE) if self.tracer_provider else trace.NoOpTracer()
        self.tokens = TokenWindow(settings.telemetry_window_s)
        self.metrics = ServerMetrics(
            self.meter_provider.get_meter(SCOPE), self.tokens, settings.price_per_gpu_hour, settings.num_gpus
        )
        self.metrics.engine_stats = self._engine_stats
        self.metrics.engine_gc = self._engine_gc
        self.steps = StepRecorder(tracer, self.metrics.step_duration, settings.step_trace_sample_rate)
        self.block_size = settings.block_size
        self.capacity = CapacityModel(settings.max_num_seqs, kv_tokens=0)  # sized by the first report
        self.metrics.capacity = self._capacity
        self.metrics.model_info = self._model_info
        self.metrics.cache_config = self._cache_config
        self.model: ModelInfo | None = None  # the engine's, once it has loaded the model
        self.stats: EngineStats | None = None  # the engine's latest report
        self.gc: GcTotals | None = None  # its process's garbage collections, as of that report
        self.statistics = ModelStatistics()  # KServe ModelStatistics, every front's requests together
        self.startup = StartupClock()  # the start-up's phases, as the engine reported them
        self.serving_after_s: float | None = None  # from the process's start to SERVING
        self.metrics.startup = self._startup

    @property
    def engine_ready(self) -> bool:
        """The engine has loaded the model (it said so with EngineReady)."""
        return self.model is not None

    def _engine_stats(self) -> EngineStats | None:
        return self.stats

    def _engine_gc(self) -> GcTotals | None:
        return self.gc

    def _model_info(self) -> dict[str, str] | None:
        """The labels of tandem_model_info: what the engine reported it built (an FP8 checkpoint runs in
        FP8 whatever the setting says)."""
        if self.model is None:
            return None
        return {
            "model": self.model.name,
            "quantization": self.model.quantization,
            "kv_cache_dtype": self.model.kv_cache_dtype,
        }

    def _cache_config(self) -> tuple[int, int] | None:
        """The labels of tandem_cache_config_info: tokens per block, and the device's blocks."""
        return None if self.stats is None else (self.block_size, self.stats.kv_blocks_total)

    def _startup(self) -> tuple[dict[str, float], float | None]:
        return self.startup.seconds, self.serving_after_s

    def _capacity(self) -> tuple[float, float] | None:
        """(capacity in generated tokens/s, the share of it the window's traffic used)."""
        capacity = self.capacity.capacity()
        if capacity is None:
            return None
        achieved = self.tokens.tokens() / self.tokens.window_s
        return capacity[0], achieved / capacity[0]

    def _observe_step(self, timing: StepTiming) -> None:
        busy = timing.compute or timing.bounds  # the device's part of the step where it is timed
        if busy is not None:
            self.capacity.observe(
                timing.batch_size, timing.context_tokens, timing.prefill_tokens, busy[1] - busy[0]
            )

    def record(self, msg: object) -> None:
        """One message from the engine or a front (on the supervisor's receiving thread)."""
        if isinstance(msg, c.StepReport):
            for timing in msg.timings:
                self.steps(timing)
                self._observe_step(timing)
            if msg.generated_tokens:
                self.tokens.add(msg.generated_tokens)
                self.metrics.generation_tokens.add(msg.generated_tokens)
            if msg.prompt_tokens:
                self.metrics.prompt_tokens.add(msg.prompt_tokens)
            self.stats, self.gc = msg.stats, msg.gc
            self.capacity.kv_tokens = msg.stats.kv_blocks_total * self.block_size
        elif isinstance(msg, c.RequestRecord):
            self.metrics.record_request(msg)
            self.statistics.record(msg)
        elif isinstance(msg, c.EngineReady):
            self.model = msg.model  # first: the pod is ready whatever its start-up account holds
            for phase, seconds in msg.startup.items():
                self.startup.add(phase, seconds)

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
