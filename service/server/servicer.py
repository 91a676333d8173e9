"""What the native and KServe servicers share: the model context, telemetry and message limit."""

from __future__ import annotations

import grpc

from ..telemetry.requests import RequestTelemetry, RequestTrace
from .auth import presented_token
from .context import ContextHolder, ModelContext


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

    def cache_scope(self, context: grpc.aio.ServicerContext, salt: str | None) -> bytes:
        """A call's prefix-cache scope: its bearer token (where the server isolates tenants) and the
        request's `cache_salt` (INVALID_ARGUMENT, as RequestError, if that is not a valid one)."""
        return self.ctx.cache_scope(presented_token(context.invocation_metadata()), salt)

    def trace(self, context: grpc.aio.ServicerContext, rpc_method: str, operation: str) -> RequestTrace:
        """The telemetry of one generation call, joined to the caller's trace context."""
        return self.telemetry.request(context.invocation_metadata(), rpc_method, operation)
