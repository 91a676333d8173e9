"""Per-request telemetry in a front: the server span `generate {model}` with children
queue/prefill/decode and GenAI attributes, and a record of the request for the pod's latency
histograms (kept by the supervisor, which serves /metrics for every front).

A servicer opens one `RequestTrace` per generation (`with telemetry.request(...) as rt`; the HTTP
front: `telemetry.http_request(...)`), tells it the admitted request and hands it every chunk it
sends; the chunks carry the times the front saw (`RequestTimes`), from which the child spans and the
request's record are made once it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import contract as c
from ..contract import RequestError, SamplingParams
from ..settings import ServerSettings
from .otel import SCOPE, tracer_provider

if TYPE_CHECKING:  # the front's chunk type: server/ imports telemetry, never the other way
    from ..server.request_stream import GenerationChunk, RequestTimes


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTelemetry:
    def __init__(
        self,
        tracer: trace.Tracer,
        record: Callable[[c.RequestRecord], None],
        close: Callable[[], None] = lambda: None,
    ) -> None:  # close: flushes the spans still buffered
        self.tracer = tracer
        self.record = record  # where a finished request's record goes
        self._close = close
        self.model = ""  # the served model's name, known once it has loaded

    @classmethod
    def for_front(cls, settings: ServerSettings, send: Callable[[c.RequestRecord], None]) -> RequestTelemetry:
        """Spans exported by this front; records sent (`send`) to the supervisor's metrics."""
        provider = tracer_provider(settings)
        tracer = provider.get_tracer(SCOPE) if provider else trace.NoOpTracer()
        return cls(tracer, send, provider.shutdown if provider else lambda: None)

    def shutdown(self) -> None:
        self._close()

    def request(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, rpc_method: str, operation: str
    ) -> RequestTrace:
        """A request arrived on `rpc_method` ("tandem.v1.Tandem/Generate"); `metadata`: the gRPC metadata."""
        service, _, method = rpc_method.rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        return RequestTrace(self, _carrier(metadata), operation, attributes)

    def http_request(self, headers: Mapping[str, str], route: str, operation: str) -> RequestTrace:
        """A request arrived on the HTTP `route` ("/v1/chat/completions"); `headers`: its HTTP headers."""
        carrier = {k: headers[k] for k in propagate.get_global_textmap().fields if k in headers}
        attributes = {"http.request.method": "POST", "http.route": route}
        return RequestTrace(self, carrier, operation, attributes)


def _carrier(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    carrier = {}
    for key, value in metadata or ():
        if isinstance(value, str):  # binary metadata (-bin keys) carries no trace context
            carrier[key.lower()] = value
    return carrier


class RequestTrace:
    def __init__(
        self,
        telemetry: RequestTelemetry,
        carrier: Mapping[str, str],
        operation: str,
        attributes: Mapping[str, str],
    ) -> None:
        """`carrier`: the caller's trace context (lower-case keys); `attributes`: the protocol's
        (rpc.*, http.*)."""
        self.telemetry = telemetry
        self.model = telemetry.model
        self.started = time.time()
        self.operation = operation
        self.span = telemetry.tracer.start_span(
            f"generate {self.model}" if self.model else "generate",
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            start_time=_ns(self.started),
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": self.model, **attributes},
        )
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt, found in the prefix cache (known with the first token)
        self.times: RequestTimes | None = None
        self.finish_reason: str | None = None

    def admitted(self, request_id: str, prompt_tokens: int, params: SamplingParams, stream: bool) -> None:
        self.prompt_tokens = prompt_tokens
        attrs = {
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k,
            "tandem.request.stream": stream,
        }
        if request_id:  # KServe: the client's optional correlation id
            attrs["gen_ai.response.id"] = request_id
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        if params.stop:
            attrs["gen_ai.request.stop_sequences"] = list(params.stop)
        self.span.set_attributes(attrs)

    def chunk(self, chunk: GenerationChunk) -> None:
        """A chunk about to be sent to the client (for unary calls: the merged result)."""
        self.times = chunk.times
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason.value

    def __enter__(self) -> RequestTrace:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        ended = time.time()
        error = None if exc is None else _error_type(exc)
        self._phases(ended)
        record = c.RequestRecord(self.operation, self.model, ended - self.started, error=error, ended=ended)
        if error is None and self.times is not None and self.times.first_token is not None:
            first, last = self.times.first_token, self.times.last_token or self.times.first_token
            record.time_to_first_token = first - self.started
            if self.completion_tokens > 1:
                record.time_per_output_token = (last - first) / (self.completion_tokens - 1)
            self._stages(record, ended)
        self.telemetry.record(record)
        span = self.span
        span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if self.times is not None and self.times.first_token is not None:  # its first admission was
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", self.cached_tokens)
        span.set_attribute("gen_ai.response.model", self.model)
        if self.finish_reason is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [self.finish_reason])
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, str(exc) or error))
        span.end(end_time=_ns(ended))

    def _stages(self, record: c.RequestRecord, ended: float) -> None:
        """A finished request's time cut where the pod handed it on (model_statistics.py)."""
        t = self.times
        assert t is not None and t.first_token is not None
        scheduled = t.scheduled if t.scheduled is not None else t.arrival
        last = t.last_token or t.first_token
        record.compute_input = t.arrival - self.started
        record.queue = scheduled - t.arrival
        record.compute_infer = last - scheduled
        record.compute_output = ended - last

    def _phases(self, ended: float) -> None:
        """Children from the front's milestones: queue -> prefill -> decode (those that were reached)."""
        t = self.times
        if t is None:
            return
        parent = trace.set_span_in_context(self.span)
        # a phase still open when the request ended (cancelled, failed) ends with it
        queue_end = t.scheduled if t.scheduled is not None else (ended if t.first_token is None else None)
        prefill_end = t.first_token if t.first_token is not None else ended
        bounds = [("queue", t.arrival, queue_end), ("prefill", t.scheduled, prefill_end)]
        bounds.append(("decode", t.first_token, t.last_token))
        for name, start, end in bounds:
            if start is not None and end is not None:
                self.telemetry.tracer.start_span(name, context=parent, start_time=_ns(start)).end(
                    end_time=_ns(end)
                )


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, RequestError):
        return exc.kind.name
    if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
        return "cancelled"
    return type(exc).__name__
