"""A front's HTTP port: uvicorn serving the OpenAI app on the front's own asyncio loop, beside grpc.aio.

Every front binds the port itself with SO_REUSEPORT, as grpc does for its port, and hands the socket
to uvicorn: the kernel spreads connections over the fronts. uvicorn installs no signal handlers
(the front's SIGTERM drains), configures no logging (the front's format stays) and writes no access
log unless asked: a line per request costs throughput. Its HTTP parser is httptools (C), not h11.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from ..settings import ServerSettings
from .tls import ServerSSLContext

log = logging.getLogger(__name__)
BACKLOG = 4096  # connections the kernel queues before the front accepts them: a burst of clients
GRACE_S = 1  # open connections get this long once the front has drained and stops
TLS_REFRESH_S = 1.0  # how often the certificate files' stat is looked at


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) that the other fronts may bind as well (SO_REUSEPORT).

    Its connections send each event at once (TCP_NODELAY, which accepted sockets inherit): with
    Nagle's algorithm, a stream's small writes on a reused connection wait for the client's
    delayed ACK, some 40 ms per event. asyncio sets it only on sockets whose protocol is TCP."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the front process handles its signals itself


class HttpServer:
    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.settings = settings
        s = settings
        self.tls: ServerSSLContext | None = None
        if s.tls_cert_file is not None and s.tls_key_file is not None:
            self.tls = ServerSSLContext(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
        config = uvicorn.Config(
            app,
            loop="none",  # the running loop: the front's, shared with grpc.aio
            http="httptools",
            lifespan="off",
            log_config=None,
            log_level=logging.INFO if settings.http_access_log else logging.WARNING,
            access_log=settings.http_access_log,
            proxy_headers=False,  # no per-request header rewriting: the pod is reached directly
            server_header=False,
            backlog=BACKLOG,
            timeout_graceful_shutdown=GRACE_S,
            ssl_context_factory=(lambda _config, _default: self.tls.context) if self.tls else None,
        )
        self.server = _EmbeddedServer(config)
        self.task: asyncio.Task | None = None
        self._refresh: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self.stopping = False  # stop() was called: the server's end is no fault

    @property
    def port(self) -> int:
        assert self._socket is not None
        return self._socket.getsockname()[1]

    async def start(self) -> None:
        """Listen; returns once uvicorn accepts connections (raises OSError if the port is taken)."""
        s = self.settings
        self._socket = listening_socket(s.host, s.http_port)
        self.task = asyncio.create_task(self.server.serve(sockets=[self._socket]), name="http")
        while not self.server.started:
            if self.task.done():
                self.task.result()  # what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        if self.tls is not None:
            self._refresh = asyncio.create_task(self._refresh_tls(), name="http-tls-refresh")

    async def _refresh_tls(self) -> None:
        assert self.tls is not None
        while True:
            await asyncio.sleep(TLS_REFRESH_S)
            self.tls.refresh()

    async def stop(self, grace: bool = True) -> None:
        """Stop listening and close the connections (at once unless `grace`: open ones get GRACE_S)."""
        self.stopping = True
        if self._refresh is not None:
            self._refresh.cancel()
        if self.task is None or self.task.done():
            return
        self.server.should_exit = True
        self.server.force_exit = not grace
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
