"""What the native and KServe servicers share: the model context, admission, telemetry and message limit."""

from __future__ import annotations

import grpc

from ..telemetry.requests import RequestTelemetry, RequestTrace
from .auth import presented_token
from .context import Admitted, ContextHolder, ModelContext, WireRequest


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

    async def admit(self, context: grpc.aio.ServicerContext, request: WireRequest) -> Admitted:
        """Admit a call's request or refuse it (RequestError): ModelContext.admit, the caller known by
        the call's bearer token."""
        return await self.ctx.admit(request, presented_token(context.invocation_metadata()))

    def trace(self, context: grpc.aio.ServicerContext, rpc_method: str, operation: str) -> RequestTrace:
        """The telemetry of one generation call, joined to the caller's trace context."""
        return self.telemetry.request(context.invocation_metadata(), rpc_method, operation)
