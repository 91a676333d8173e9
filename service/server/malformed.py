"""Requests that are not valid protobuf get INVALID_ARGUMENT on every method, health and reflection
included, instead of grpc's UNKNOWN and a traceback per call.

An interceptor hands each method its request bytes unparsed and parses them itself: a message that
does not parse ends the call with INVALID_ARGUMENT, and the log says so at most once a minute.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from .interceptor_kit import RateLimitedLog, handler_kind

log = logging.getLogger(__name__)


class MalformedRequests(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._log = RateLimitedLog(log, "malformed request")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method
        original = next(
            h
            for h in (handler.unary_unary, handler.unary_stream, handler.stream_unary, handler.stream_stream)
            if h is not None
        )
        if not (inspect.iscoroutinefunction(original) or inspect.isasyncgenfunction(original)):
            return handler  # a synchronous handler: grpc runs it in its executor, as it is

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            try:
                return parse(raw)
            except (DecodeError, ValueError) as exc:  # ValueError: e.g. invalid UTF-8 in a string field
                self._log(method, exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")

        async def each(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator:
            async for raw in requests:
                yield await parsed(raw, context)

        if not handler.request_streaming:
            behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

            if inspect.isasyncgenfunction(behavior):

                async def call(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator:
                    async for out in behavior(await parsed(raw, context), context):
                        yield out
            else:

                async def call(raw: bytes, context: grpc.aio.ServicerContext) -> object:
                    return await behavior(await parsed(raw, context), context)

        else:
            behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary

            if inspect.isasyncgenfunction(behavior):

                async def call(
                    raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                ) -> AsyncIterator:
                    async for out in behavior(each(raws, context), context):
                        yield out
            else:

                async def call(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> object:
                    return await behavior(each(raws, context), context)

        return handler._replace(request_deserializer=None, **{handler_kind(handler): call})
