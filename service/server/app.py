"""The model-server process: gRPC server up first (health NOT_SERVING), then load, warm up, serve.

SIGTERM starts a drain: health turns NOT_SERVING at once, new generations get UNAVAILABLE,
running streams may finish for `drain_timeout_s`, then the server stops; during the load or the
engine build it stops at once, without waiting for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from tandem.kserve import grpc_service_pb2, grpc_service_pb2_grpc
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

from ..engine.async_engine import AsyncEngine
from ..engine.factory import build_engine, resolve_device
from ..engine.validation import resolve_params
from ..models.loader import load_model
from ..settings import ServerSettings
from ..telemetry.http import MetricsServer
from ..telemetry.otel import Telemetry
from .background import in_daemon_thread
from .context import ContextHolder, ModelContext
from .kserve import KServeServicer
from .native import TandemServicer

log = logging.getLogger("tandem.serve")

SERVICE_NAMES = (
    tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name,
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


async def _warm_up(engine: AsyncEngine) -> None:
    """One short generation so the first user request does not pay for lazy initialisation."""
    prompt = [0] * min(8, engine.limits.max_model_len - 2)
    params = resolve_params(engine.limits, len(prompt), max_tokens=2, ignore_eos=True)
    await engine.generate_all(prompt, params)


class ModelServer:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.holder = ContextHolder()
        self.health = health_aio.HealthServicer()
        self.draining = False
        self.port: int | None = None
        self.server: grpc.aio.Server | None = None
        self.engine: AsyncEngine | None = None
        self.serving = asyncio.Event()
        self.telemetry = Telemetry(settings)
        self.metrics_server: MetricsServer | None = None

    def _alive(self) -> bool:
        return self.engine is None or self.engine.core.alive

    def _ready(self) -> bool:
        return self.serving.is_set() and not self.draining

    async def _set_health(self, status: int) -> None:
        for name in ("", *SERVICE_NAMES[:2]):
            await self.health.set(name, status)

    async def start(self) -> None:
        limit = self.settings.max_message_bytes
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        requests = self.telemetry.requests
        native = TandemServicer(self.holder, requests, limit)
        tandem_pb2_grpc.add_TandemServicer_to_server(native, self.server)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeServicer(self.holder, requests, limit), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(SERVICE_NAMES, self.server)
        self.port = self.server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.settings.metrics_port:
            self.metrics_server = MetricsServer(self.settings.host, self.settings.metrics_port, self._alive)
            self.metrics_server.start()
            log.info("metrics on http://%s:%d/metrics", self.settings.host, self.metrics_server.port)
        await self.server.start()
        log.info(
            "gRPC listening on %s:%d (NOT_SERVING until the model is warm)", self.settings.host, self.port
        )

    async def load(self) -> None:
        s = self.settings
        t0 = time.perf_counter()
        device = resolve_device(s.device)
        loaded = await in_daemon_thread(
            load_model, s.model, s.model_name, device, s.dtype, s.cache_dir, name="tandem-load"
        )
        if self.draining:  # stopped while loading: never turn SERVING
            return
        # graph capture and compilation take minutes on a large model: off the event loop, so
        # health checks and signals are answered meanwhile
        self.engine = await in_daemon_thread(build_engine, loaded, s, name="tandem-build")
        if self.draining:
            return
        self.engine.start()
        self.holder.ctx = ModelContext(
            engine=self.engine,
            tokenizer=loaded.tokenizer,
            name=loaded.name,
            source=loaded.source,
            architecture=(loaded.model.config.architectures or [type(loaded.model).__name__])[0],
            dtype=str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
            device=str(device),
            eos_token_ids=sorted(loaded.eos_token_ids),
            is_ready=self._ready,
        )
        if s.warmup:
            await _warm_up(self.engine)
        if self.draining:
            return
        self.telemetry.watch(self.engine.core, loaded.name)  # after warm-up: its steps are not traffic
        self.serving.set()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("model %r ready in %.1f s on %s", loaded.name, time.perf_counter() - t0, device)

    async def drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.engine is not None and self.engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        log.info("drained; stopping")
        if self.server is not None:
            await self.server.stop(grace=1.0)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
        if self.engine is not None:
            self.engine.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.telemetry.shutdown()  # flushes spans still buffered


async def serve(settings: ServerSettings) -> None:
    server = ModelServer(settings)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    load = asyncio.create_task(server.load())
    stopped = asyncio.create_task(server.server.wait_for_termination())
    try:
        done, _ = await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if load in done:
            load.result()  # a failed load ends the process with its error
            await stopped
    finally:
        await server.close()
        if not load.done():  # drained while loading or building: abandon that work, exit now
            log.info("stopped before the model was ready; not waiting for the load to finish")
            logging.shutdown()
            sys.stdout.flush()
            os._exit(0)
