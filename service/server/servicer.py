"""What the native and KServe servicers share: the model context, generation, and the message limit."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from ..telemetry.requests import RequestTelemetry
from .auth import presented_token
from .context import ContextHolder, ModelContext, WireRequest
from .request_stream import GenerationChunk


class Servicer:
    def __init__(
        self, holder: ContextHolder, telemetry: RequestTelemetry, max_message_bytes: int | None = None
    ) -> None:
        self.holder = holder
        self.telemetry = telemetry
        self.max_message_bytes = max_message_bytes

    @property
    def ctx(self) -> ModelContext:
        """The served model; UNAVAILABLE (RequestError) while it is still loading."""
        return self.holder.get()

    def generate(
        self,
        context: grpc.aio.ServicerContext,
        request: WireRequest,
        rpc_method: str,
        operation: str,
        response_id: str,
    ) -> AsyncIterator[GenerationChunk]:
        """ModelContext.generate for one call: traced under `rpc_method` ("tandem.v1.Tandem/Generate")
        as a GenAI `operation`, joined to the caller's trace context, the caller known by its bearer
        token, within the call's deadline."""
        ctx = self.ctx
        metadata = context.invocation_metadata()
        trace = self.telemetry.request(metadata, rpc_method, operation)
        return ctx.generate(request, presented_token(metadata), trace, response_id, context.time_remaining())
