"""OpenTelemetry for the server: the meter and tracer providers and their exporters.

Export follows the standard OTEL_* variables (endpoint, headers, TLS, sampler, resource,
OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER = none) plus the TANDEM_ settings. Without an OTLP
endpoint no span is built at all (a no-op tracer) and metrics go to /metrics only.
"""

from __future__ import annotations

import logging
import os

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from ..settings import ServerSettings

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


def meter_provider(settings: ServerSettings) -> MeterProvider:
    """The pod's meters: read by /metrics (when `metrics_port` is set) and exported over OTLP when
    a collector is configured. Only the supervisor keeps meters: one set for the whole pod."""
    readers: list[MetricReader] = []
    if settings.metrics_port:
        readers.append(PrometheusMetricReader())  # feeds prometheus-client's registry: /metrics
    otlp = _exports(settings, "metrics")
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=settings.otlp_endpoint)))
    log.info("telemetry: OTLP metrics %s", "on" if otlp else "off")
    return MeterProvider(metric_readers=readers, resource=_resource())


def tracer_provider(settings: ServerSettings) -> TracerProvider | None:
    """Spans exported over OTLP (sampler: OTEL_TRACES_SAMPLER); None = no export, no spans built.
    Each process that makes spans has its own (the fronts: requests; the supervisor: steps)."""
    if not _exports(settings, "traces"):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=_resource())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    return provider
