"""What the server's interceptors share: a rate-limited warning, and which kind a method handler is."""

from __future__ import annotations

import logging
import time

import grpc

LOG_EVERY_S = 60.0


class RateLimitedLog:
    """A warning a client can trigger on every call, logged at most once a minute with a count."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._last = -LOG_EVERY_S
        self._quiet = 0

    def __call__(self, method: str, detail: object) -> None:
        now = time.monotonic()
        if now - self._last < LOG_EVERY_S:
            self._quiet += 1
            return
        more = f" ({self._quiet} more since the last report)" if self._quiet else ""
        self._logger.warning("%s on %s: %s%s", self._what, method, detail, more)
        self._last, self._quiet = now, 0


def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    """The field holding its behaviour: unary_unary, unary_stream, stream_unary or stream_stream."""
    return {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, False): "stream_unary",
        (True, True): "stream_stream",
    }[(handler.request_streaming, handler.response_streaming)]
