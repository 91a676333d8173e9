"""Map engine request errors to gRPC status codes."""

from __future__ import annotations

import grpc

from ..engine.errors import ErrorKind, RequestError

STATUS = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


async def abort(context: grpc.aio.ServicerContext, err: RequestError) -> None:
    """End the call with the error's status; raises, as grpc.aio's abort does."""
    await context.abort(STATUS[err.kind], err.message)
