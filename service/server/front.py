"""A front process: the native and KServe gRPC APIs, health and reflection, and the OpenAI HTTP API
(`http_port`) on the same event loop, all feeding the engine process.

The gRPC and HTTP servers are up first with health NOT_SERVING (HTTP /ready: 503); they turn
SERVING once the engine reports ready and the front has loaded the model's tokenizer. SIGTERM (sent
by the supervisor) starts a drain: health turns NOT_SERVING at once, new generations get UNAVAILABLE
(HTTP 503), running streams may finish for `drain_timeout_s`, then the front stops. If the engine
process goes away, health turns NOT_SERVING, every stream ends with UNAVAILABLE and the front stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.kserve import grpc_service_pb2, grpc_service_pb2_grpc
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

from .. import contract as c
from ..ipc import sockets
from ..models.default_model import served_name
from ..models.paths import model_files_dir
from ..runtime.child import exit_now, init_child
from ..settings import ServerSettings
from ..telemetry.requests import RequestTelemetry
from .auth import RequireBearerToken, TokenFile
from .background import in_daemon_thread
from .context import ContextHolder, ModelContext, longest_token_chars
from .engine_client import EngineClient
from .http_server import HttpServer
from .kserve import KServeServicer
from .malformed import MalformedRequests
from .native import TandemServicer
from .openai_http import OpenAIApi
from .pod_statistics import PodStatistics
from .request_stream import StreamInterval
from .tls import CertificateFiles
from .tokenizer_files import tokenizer_files
from .tool_calls.choice import tool_support

log = logging.getLogger("tandem.front")

SERVICE_NAMES = (
    tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name,
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


def _load_tokenizer(path: str) -> tuple[PreTrainedTokenizerBase, int, dict[str, Path]]:
    """The tokenizer, its longest token's characters, and its files (those clients may fetch)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    files = tokenizer_files(Path(path), tokenizer.vocab_files_names.values())
    return tokenizer, longest_token_chars(tokenizer), files


class FrontServer:
    def __init__(self, settings: ServerSettings, index: int, endpoints: sockets.Endpoints) -> None:
        self.settings = settings
        self.index = index
        self.endpoints = endpoints
        self.holder = ContextHolder()
        self.health = health_aio.HealthServicer()
        self.draining = False
        self.serving = False
        self.failed = False  # it could not get ready (the tokenizer would not load), or HTTP failed
        # (its path, its load) where the tokenizer could be loaded before the engine named it
        self._preloaded: tuple[str, asyncio.Task] | None = None
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None  # plaintext, health only (probes under TLS)
        self.http: HttpServer | None = None  # the OpenAI API, when http_port is set
        self.client: EngineClient | None = None
        self._zmq = zmq.Context()
        self._to_supervisor = sockets.push(self._zmq, endpoints.supervisor)
        self.telemetry = RequestTelemetry.for_front(settings, self._tell_supervisor)
        self._tasks: list[asyncio.Task] = []

    def _tell_supervisor(self, msg: object) -> None:
        self._to_supervisor.send(c.encode(msg))

    def _ready(self) -> bool:
        return self.serving and not self.draining

    def _live(self) -> bool:
        return self.client is not None and not self.client.gone.done()

    async def _set_health(self, status: int) -> None:
        for name in ("", *SERVICE_NAMES[:2]):
            await self.health.set(name, status)

    async def start(self) -> None:
        s = self.settings
        self.client = EngineClient(
            self.endpoints, self.index, StreamInterval(s.stream_interval, s.stream_interval_ms / 1000)
        )
        statistics = PodStatistics(self.index, self._tell_supervisor)
        self.client.on_statistics = statistics.answer
        limit = s.max_message_bytes
        # grpc core drops calls the server has not picked up yet past a pending limit (1,000, and
        # at random towards 3,000) as CANCELLED, which clients seldom retry: keep it far above the
        # engine's own bound, whose refusal (RESOURCE_EXHAUSTED) says what happened
        pending = max(3000, 4 * (s.max_waiting_requests + s.max_num_seqs))
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequests()]
        tokens = TokenFile(s.auth_token_file) if s.auth_token_file is not None else None
        if tokens is not None:  # outermost: a call without a token is refused before parsing
            interceptors.insert(0, RequireBearerToken(tokens))
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.server.max_pending_requests", pending),
                ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
            ],
        )
        tandem_pb2_grpc.add_TandemServicer_to_server(
            TandemServicer(self.holder, self.telemetry, limit), self.server
        )
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeServicer(
                self.holder, self.telemetry, limit, is_live=self._live, statistics=statistics.models,
                served_name=served_name(s.model, s.model_name),
            ),
            self.server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if s.reflection:
            reflection.enable_server_reflection(SERVICE_NAMES, self.server)
        # every front binds the same ports (grpc sets SO_REUSEPORT): the kernel spreads connections
        address = f"{s.host}:{s.port}"
        if s.tls_cert_file is not None and s.tls_key_file is not None:
            files = CertificateFiles(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
            port = self.server.add_secure_port(address, files.server_credentials())
        else:
            port = self.server.add_insecure_port(address)
        if s.health_port:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_server.add_insecure_port(f"{s.host}:{s.health_port}")
        if s.http_port:
            api = OpenAIApi(self.holder, self.telemetry, limit, tokens, self._live, self._ready)
            self.http = HttpServer(api.app, s)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        if self.http is not None:
            await self.http.start()
        if self.index == 0:
            how = ("mutual TLS" if s.tls_client_ca_file else "TLS") if s.tls else "plaintext"
            auth = ", bearer tokens" if s.auth_token_file else ""
            log.info("gRPC (%s%s) on %s:%d (NOT_SERVING until the model is warm)", how, auth, s.host, port)
            if self.health_server is not None:
                log.info("grpc.health.v1 (plaintext) on %s:%d", s.host, s.health_port)
            if self.http is not None:
                log.info("OpenAI HTTP API (%s%s) on %s:%d", how, auth, s.host, self.http.port)
        # the tokenizer the engine will name, loaded beside the engine's start where it is known now
        expected = model_files_dir(s.model, s.cache_dir)
        self._preloaded = None if expected is None else (str(expected), asyncio.create_task(
            in_daemon_thread(_load_tokenizer, str(expected), name="tokenizer")))
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._become_ready())]

    async def _receive(self) -> None:
        assert self.client is not None
        try:
            await self.client.run()
        except Exception:  # a message the front cannot read: it can no longer serve its streams
            log.exception("the front's connection to the engine failed")
            self.client.engine_gone("the front could not read the engine's messages")

    async def _become_ready(self) -> None:
        try:
            await self._load_context()
        except Exception:
            log.exception("the front could not get ready; stopping it")
            self.failed = True
            await self._stop_servers(grace=None)

    async def _load_context(self) -> None:
        assert self.client is not None
        ready = await self.client.ready
        info = ready.model
        loaded = None
        if self._preloaded is not None and self._preloaded[0] == info.tokenizer_path:
            try:
                loaded = await self._preloaded[1]
            except Exception:  # loaded again below from what the engine named, and failed there if it must
                log.warning("the tokenizer loaded ahead failed; loading it again", exc_info=True)
        if loaded is None:
            loaded = await in_daemon_thread(_load_tokenizer, info.tokenizer_path, name="tokenizer")
        tokenizer, longest, files = loaded
        self.telemetry.model = info.name
        s = self.settings
        self.holder.ctx = ModelContext(
            self.client, tokenizer, ready.limits, info, self._ready, longest, s.request_timeout_s,
            isolate_tokens=s.prefix_cache_isolation == "token" and s.auth_token_file is not None,
            tokenizer_files=files,
            tool_support=tool_support(s.tool_call_parser, getattr(tokenizer, "chat_template", None),
                                      info.architecture),
        )
        self._tell_supervisor(c.FrontReady(self.index))
        await self.client.pod_ready  # SERVING on one front only once every front would answer as well
        if self.draining or self.client.gone.done():
            return
        self.serving = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.client is not None and self.client.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self._stop_servers(grace=1.0)

    async def _stop_servers(self, grace: float | None) -> None:
        if self.http is not None:
            await self.http.stop(grace=grace is not None)
        for server in (self.server, self.health_server):
            if server is not None:
                await server.stop(grace=grace)

    async def stopped(self) -> None:
        """Returns once the servers have stopped. An HTTP server that ends of its own accord is a
        fault: the front stops with it, and the pod restarts."""
        assert self.server is not None
        stopped = asyncio.create_task(self.server.wait_for_termination())
        ends = {stopped} if self.http is None else {stopped, self.http.task}
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        if not stopped.done() and self.http is not None and not self.http.stopping:
            log.error("the HTTP server stopped unexpectedly; stopping the front")
            self.failed = True
            await self._stop_servers(grace=None)
        await stopped

    async def engine_gone(self) -> None:
        """The engine process went away: its streams have failed with UNAVAILABLE; stop serving."""
        assert self.client is not None
        await self.client.gone
        self.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._stop_servers(grace=1.0)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self._stop_servers(grace=None)
        if self.client is not None:
            self.client.close()
        self.telemetry.shutdown()  # flushes spans still buffered
        self._to_supervisor.close()  # after what it holds has gone out (its linger)
        self._zmq.term()


async def serve_front(settings: ServerSettings, index: int, endpoints: sockets.Endpoints) -> int:
    front = FrontServer(settings, index, endpoints)
    await front.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(front.drain()))
    assert front.client is not None
    gone = asyncio.create_task(front.engine_gone())
    try:
        await front.stopped()
    finally:
        failed = front.client.gone.done() or front.failed
        gone.cancel()
        await front.close()
    return 1 if failed else 0


def front_main(settings: ServerSettings, index: int, endpoints: sockets.Endpoints, log_level: str) -> None:
    """A front process's entry point (spawned by the supervisor)."""
    init_child(log_level)
    exit_now(asyncio.run(serve_front(settings, index, endpoints)))
