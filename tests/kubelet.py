"""The controllers kmock does not have, played by the test: Deployment replicas -> Pod objects,
each backed by something that answers on its own loopback address 127.0.0.N.

Two kinds of pod backends:
- `MetricsPod`: a real HTTP server serving Prometheus text from a real prometheus_client
  registry with the server's metric names; the test sets the load it reports, or the raw bytes
  it answers with instead (a bad body).
- `ServerPod`: a real `tandem serve` process on the tiny model, started with the environment of
  the Deployment's container; it is ready when its gRPC health says SERVING (what the kubelet's
  readiness probe asks).

The kubelet talks to kmock over HTTP like any client, so the operator sees watch events.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tandem.operator.kube import KubeApi, NotFound, api_path
from tandem.operator.resources import MODEL_LABEL

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class Backend(Protocol):
    address: str

    async def ready(self) -> bool: ...

    def stop(self) -> None: ...


def _port_free(address: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


class Addresses:
    """127.0.0.N addresses whose ports are free, from a random start (parallel test runs)."""

    def __init__(self, ports: tuple[int, ...]) -> None:
        self.ports = ports
        self.next = random.randint(20, 200)

    def take(self) -> str:
        for _ in range(250):
            self.next = self.next % 250 + 2
            address = f"127.0.0.{self.next}"
            if all(_port_free(address, p) for p in self.ports):
                return address
        raise RuntimeError("no free loopback address")


class MetricsPod:
    def __init__(self, address: str, port: int) -> None:
        self.address = address
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tandem_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("tandem_requests_waiting", "Requests queued for admission.", registry=r)
        self.kv = Gauge("tandem_kv_cache_usage_ratio", "Share of KV-cache blocks in use.", registry=r)
        self.idle = Gauge(
            "tandem_gpu_idle_fraction", "Share of the window with no step in flight.", registry=r
        )
        self.tokens = Counter("tandem_generation_tokens", "Tokens generated.", registry=r)
        # what the pod could generate at its mix; 0 (never set) reads as not reported
        self.capacity = Gauge("tandem_capacity_tokens_per_second", "Capacity.", registry=r)
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds", "TTFT.", buckets=TTFT_BUCKETS, registry=r
        )
        self.idle.set(1.0)
        self.body: bytes | None = None  # set: answered instead of the registry's text
        self.requests = 0  # GETs answered: whether the operator scraped this pod at all
        self.busy_s = 0.0  # how long a scrape waits before the pod reads its counters (a busy pod)
        self._rate = 0.0  # tokens/s generated steadily (serve_rate), counted as each scrape reads them
        self._since = time.monotonic()
        self._counting = threading.Lock()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                pod.requests += 1
                time.sleep(pod.busy_s)
                pod._accrue()
                body = pod.body if pod.body is not None else generate_latest(pod.registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def load(
        self,
        running: float,
        waiting: float,
        kv: float,
        idle: float,
        tokens: float,
        ttft: float,
        capacity: float = 0.0,
    ) -> None:
        self.capacity.set(capacity)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv.set(kv)
        self.idle.set(idle)
        self.tokens.inc(tokens)
        self.ttft.observe(ttft)

    def serve_rate(self, tokens_per_s: float) -> None:
        """From now on the pod generates `tokens_per_s` steadily: its counter reads exactly that rate
        at every scrape, however late the test's own loop runs on a loaded host."""
        self._accrue()
        with self._counting:
            self._rate = tokens_per_s

    def _accrue(self) -> None:
        with self._counting:
            now = time.monotonic()
            if self._rate:
                self.tokens.inc(self._rate * (now - self._since))
            self._since = now

    async def ready(self) -> bool:
        return True

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ServerPod:
    def __init__(self, address: str, model: Path, env: dict[str, str], log: Path) -> None:
        self.address = address
        self.grpc_target = f"{address}:{env.get('TANDEM_PORT', '50051')}"
        env = {k: v for k, v in env.items() if k not in ("TANDEM_CACHE_DIR", "TANDEM_MODEL")}
        # the HTTP API stays off: port 8000 is often taken on a test host, and the operator never calls it
        full_env = {**os.environ, **env, "TANDEM_HOST": address, "PYTHONSAFEPATH": "1"}
        full_env["TANDEM_HTTP_PORT"] = "0"
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--device", "cpu"]
        cmd += ["--kv-cache-cpu-gib", "0.05"]
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=full_env, cwd="/", stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"server on {self.address} exited with {self.proc.returncode}: see {self.log.name}"
            )
        async with grpc.aio.insecure_channel(self.grpc_target) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1
                )
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# What a ModelServer owns, for the garbage collector
OWNED = (("apps/v1", "deployments"), ("v1", "services"), ("policy/v1", "poddisruptionbudgets"))
MODELSERVERS = ("tandem.dev/v1alpha1", "modelservers")


class Kubelet:
    """Deployment controller + kubelet + garbage collector for one namespace, one tick at a time."""

    def __init__(self, api: KubeApi, namespace: str, backend_factory: callable) -> None:
        self.api = api
        self.namespace = namespace
        self.backend_factory = backend_factory  # (address, container) -> Backend
        self.backends: dict[str, Backend] = {}
        self.serial = 0

    def pods_of(self, deployment: str) -> list[Backend]:
        return [b for name, b in self.backends.items() if name.startswith(deployment + "-")]

    async def collect_garbage(self) -> None:
        """Delete what a ModelServer owned once no ModelServer of that uid exists (as Kubernetes'
        garbage collector does, by the ownerReferences' uid)."""
        ns = self.namespace
        alive = {m["metadata"].get("uid") for m in await self.api.list(api_path(*MODELSERVERS, ns))}
        for api_version, plural in OWNED:
            for obj in await self.api.list(api_path(api_version, plural, ns)):
                owners = [
                    r for r in obj["metadata"].get("ownerReferences") or [] if r.get("kind") == "ModelServer"
                ]
                if owners and not any(r.get("uid") in alive for r in owners):
                    with contextlib.suppress(NotFound):
                        await self.api.delete(api_path(api_version, plural, ns, obj["metadata"]["name"]))

    async def tick(self) -> None:
        ns = self.namespace
        await self.collect_garbage()
        deployments = await self.api.list(api_path("apps/v1", "deployments", ns))
        pods = await self.api.list(api_path("v1", "pods", ns))
        names = {d["metadata"]["name"] for d in deployments}
        for pod in pods:  # pods whose Deployment is gone: what the garbage collector would do
            if pod["metadata"]["labels"].get(MODEL_LABEL) not in names:
                await self._delete_pod(pod["metadata"]["name"])
        for deployment in deployments:
            await self._reconcile(deployment, [p for p in pods if self._owned(p, deployment)])

    @staticmethod
    def _owned(pod: dict, deployment: dict) -> bool:
        return pod["metadata"]["labels"].get(MODEL_LABEL) == deployment["metadata"]["name"]

    async def _reconcile(self, deployment: dict, pods: list[dict]) -> None:
        name = deployment["metadata"]["name"]
        wanted = int(deployment["spec"].get("replicas") or 0)
        pods = sorted(pods, key=lambda p: p["metadata"]["name"])
        for pod in pods[wanted:]:
            await self._delete_pod(pod["metadata"]["name"])
        pods = pods[:wanted]
        template = deployment["spec"]["template"]
        for _ in range(wanted - len(pods)):
            self.serial += 1
            pod_name = f"{name}-{self.serial}"
            backend = self.backend_factory(template["spec"]["containers"][0])
            self.backends[pod_name] = backend
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod_name,
                    "namespace": self.namespace,
                    "labels": dict(template["metadata"]["labels"]),
                    "resourceVersion": "1",
                },
                "spec": template["spec"],
                "status": {"phase": "Pending", "podIP": backend.address},
            }
            pods.append(await self.api.create(api_path("v1", "pods", self.namespace), pod))
        ready = 0
        for pod in pods:
            backend = self.backends.get(pod["metadata"]["name"])
            is_ready = backend is not None and await backend.ready()
            ready += is_ready
            was_ready = pod.get("status", {}).get("phase") == "Running"
            if is_ready and not was_ready:
                status = {
                    "phase": "Running",
                    "podIP": backend.address,
                    "conditions": [{"type": "Ready", "status": "True"}],
                }
                await self.api.patch(
                    api_path("v1", "pods", self.namespace, pod["metadata"]["name"]), {"status": status}
                )
        status = {"replicas": len(pods), "readyReplicas": ready, "availableReplicas": ready}
        if deployment.get("status") != status:
            await self.api.patch(api_path("apps/v1", "deployments", self.namespace, name), {"status": status})

    async def _delete_pod(self, name: str) -> None:
        backend = self.backends.pop(name, None)
        if backend is not None:
            await asyncio.to_thread(backend.stop)
        with contextlib.suppress(NotFound):
            await self.api.delete(api_path("v1", "pods", self.namespace, name))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.tick()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    async def shutdown(self) -> None:
        for name in list(self.backends):
            await self._delete_pod(name)
