
"""Map engine request errors to gRPC status codes."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import Message

from ..contract import ErrorKind, RequestError

STATUS = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


async def abort(context: grpc.aio.ServicerContext, err: RequestError) -> None:
    """End the call with the error's status; raises, as grpc.aio's abort does.

    A call that grpc has ended already (its deadline and ours expire together, or the client went)
    has nobody to tell: it ends as cancelled, quietly, instead of an abort that fails in grpc core
    and logs an error with two tracebacks.
    """
    if context.done():
        raise asyncio.CancelledError
    try:
        await context.abort(STATUS[err.kind], err.message)
    except grpc.aio.AbortError:
        raise
    except Exception:
        if context.done():  # it ended between the check and the abort
            raise asyncio.CancelledError from None
        raise


async def abort_if_too_large(context: grpc.aio.ServicerContext, response: Message, limit: int | None) -> None:
    """A unary response past the message limit ends as RESOURCE_EXHAUSTED with a clear message.

    grpc would refuse it too, but while serializing, with a traceback in the server's log.
    """
    if limit is None:
        return
    size = response.ByteSize()
    if size > limit:
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the response ({size} bytes) exceeds the server's message limit of {limit} bytes "
            "(--max-message-bytes): stream it instead, or ask for fewer tokens or logprobs",
        )
