"""OpenTelemetry for the server: providers, exporters and the recorders built on them.

Export follows the standard OTEL_* variables (endpoint, headers, TLS, sampler, resource,
OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER = none) plus the TANDEM_ settings. Without an OTLP
endpoint no span is built at all (a no-op tracer) and metrics go to /metrics only.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from ..engine.engine_core import EngineCore
from ..settings import ServerSettings
from .cost import TokenWindow
from .metrics import ServerMetrics
from .requests import RequestTelemetry
from .steps import StepRecorder

log = logging.getLogger(__name__)
SCOPE = "tandem"


def _exports(settings: ServerSettings, signal: str) -> bool:
    """Whether `signal` ("traces" or "metrics") goes to an OTLP collector."""
    if not settings.telemetry or os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "otlp") == "none":
        return False
    return bool(
        settings.otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    )


def _resource() -> Resource:
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "tandem"}))
    return resource


class Telemetry:
    """Everything the server records; `shutdown()` flushes what is still buffered."""

    def __init__(self, settings: ServerSettings) -> None:
        resource = _resource()
        readers: list[MetricReader] = []
        if settings.metrics_port:
            readers.append(PrometheusMetricReader())  # feeds prometheus-client's registry: /metrics
        if _exports(settings, "metrics"):
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=settings.otlp_endpoint)))
        self.meter_provider = MeterProvider(metric_readers=readers, resource=resource)
        self.tracer_provider: TracerProvider | None = None
        tracer: trace.Tracer = trace.NoOpTracer()
        if _exports(settings, "traces"):
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            self.tracer_provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER
            self.tracer_provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint))
            )
            tracer = self.tracer_provider.get_tracer(SCOPE)
        self.tokens = TokenWindow(settings.telemetry_window_s)
        self.metrics = ServerMetrics(
            self.meter_provider.get_meter(SCOPE), self.tokens, settings.price_per_gpu_hour, settings.num_gpus
        )
        self.requests = RequestTelemetry(tracer, self.metrics)
        self.steps = StepRecorder(tracer, self.metrics.step_duration, settings.step_trace_sample_rate)
        self.window_s = settings.telemetry_window_s
        log.info(
            "telemetry: OTLP traces %s, OTLP metrics %s",
            "on" if self.tracer_provider else "off",
            "on" if len(readers) > int(bool(settings.metrics_port)) else "off",
        )

    def watch(self, core: EngineCore, model: str) -> None:
        """Start recording the engine that serves `model` (once it has loaded)."""
        core.idle.window_s = self.window_s  # idle fraction and cost share one window
        core.step_observer = self.steps
        self.metrics.engine_stats = core.stats
        self.requests.model = model

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
