"""The HTTP side of the server: Prometheus `/metrics` and the liveness probe `/healthz`.

A small threaded WSGI server (prometheus-client's) on its own port, so a scrape never waits on the
gRPC event loop or the engine thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

StartResponse = Callable[[str, list[tuple[str, str]]], object]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
        """Probes and scrapes come every few seconds: no access log."""


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]


class MetricsServer:
    """`/metrics` from `registry`; `/healthz` answers 200 while `is_alive()` holds, else 503.
    `before_scrape`: called before each `/metrics` is rendered (the supervisor's: wait until what
    was reported to it is recorded)."""

    def __init__(
        self,
        host: str,
        port: int,
        is_alive: Callable[[], bool] = lambda: True,
        registry: CollectorRegistry = REGISTRY,
        before_scrape: Callable[[], object] = lambda: None,
    ) -> None:
        self.is_alive = is_alive
        self.before_scrape = before_scrape
        self._metrics = make_wsgi_app(registry)
        server_cls = type("_Server", (ThreadingWSGIServer,), {"address_family": _family(host)})
        self._server = make_server(
            host, port, self._app, server_class=server_cls, handler_class=_QuietHandler
        )
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="tandem-metrics", daemon=True)

    def _app(self, environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            self.before_scrape()
            return self._metrics(environ, start_response)
        if path == "/healthz":
            alive = self.is_alive()
            start_response("200 OK" if alive else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if alive else b"engine thread is not running\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
