"""Bearer-token authentication: every RPC but grpc.health.v1 needs `authorization: Bearer <token>`
(and every HTTP request under /v1: openai_http.py asks the same `TokenFile`).

The accepted tokens live in a file (a Kubernetes Secret volume), one per line, read again when the
file changes so that a token can be added or revoked without a restart. A presented token is
compared with every accepted one in constant time. Probes need no token: health carries no data.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc

from .interceptor_kit import RateLimitedLog, handler_kind

log = logging.getLogger(__name__)
RECHECK_S = 1.0  # how often the token file's stat is looked at, at most
EXEMPT_PREFIX = "/grpc.health.v1.Health/"
SCHEME = "bearer "


def parse_tokens(text: str) -> list[bytes]:
    lines = (line.strip() for line in text.splitlines())
    return [line.encode() for line in lines if line and not line.startswith("#")]


class TokenFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._checked = 0.0
        self._stamp: tuple[int, int, int] | None = None
        self._tokens: list[bytes] = []
        self._reload()
        if not self._tokens:
            raise ValueError(f"the token file {path} holds no token: no client could call")

    def _reload(self) -> None:
        st = os.stat(self.path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._tokens = parse_tokens(self.path.read_text())
        if self._stamp is not None:
            log.info("token file %s reloaded: %d token(s)", self.path, len(self._tokens))
            if not self._tokens:
                log.warning("the token file %s holds no token: every call is refused", self.path)
        self._stamp = stamp

    def tokens(self) -> list[bytes]:
        now = time.monotonic()
        if now - self._checked >= RECHECK_S:
            self._checked = now
            try:
                self._reload()
            except OSError as exc:  # mid-rotation, or removed: the tokens read last stay
                log.warning("token file %s unreadable, keeping the tokens read last: %s", self.path, exc)
        return self._tokens

    def accepts(self, presented: bytes) -> bool:
        ok = False
        for token in self.tokens():  # no early exit: the time does not tell which token matched
            ok |= hmac.compare_digest(presented, token)
        return ok


def bearer_token(value: str | None) -> bytes | None:
    """The token of an `authorization` value `Bearer <token>` (the scheme in any case), else None."""
    if value is not None and value[: len(SCHEME)].lower() == SCHEME:
        return value[len(SCHEME) :].strip().encode()
    return None


def presented_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> bytes | None:
    """The bearer token in a call's metadata, if any (the interceptor has checked it when auth is on)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and (token := bearer_token(value)) is not None:
            return token
    return None


class RequireBearerToken(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: TokenFile) -> None:
        self.tokens = tokens
        self._log = RateLimitedLog(log, "unauthenticated call")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIX):
            return handler
        presented = presented_token(details.invocation_metadata)
        if presented is not None and self.tokens.accepts(presented):
            return handler
        why = "missing bearer token" if presented is None else "bearer token not accepted"
        self._log(details.method, why)  # never the token itself
        return _refusing(handler, why)


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """The same method, answering UNAUTHENTICATED before it reads anything."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def refuse_stream(_request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # an async generator, as grpc expects of a streaming method

    behaviour = refuse_stream if handler.response_streaming else refuse
    return handler._replace(**{handler_kind(handler): behaviour})
