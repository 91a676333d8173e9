"""End to end with real model servers: the test kubelet starts a real `tandem serve` process on the
tiny model for each pod, on its own 127.0.0.N, with the environment of the operator's Deployment;
real gRPC load makes the operator scale up, quiet makes it scale down after the window."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import kopf
import pytest
from kubelet import Addresses, ServerPod
from test_operator_e2e import (
    MS,
    NS,
    condition,
    declare_resources,
    events,
    eventually,
    kubelet_running,
    model_server,
    operator_running,
    posted,
)

from tandem.operator.kube import KubeApi, api_path
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

pytestmark = pytest.mark.asyncio


async def _stream(address: str, stop: asyncio.Event) -> None:
    """Long generations (the tiny model holds 1,024 tokens), one after the other, until told to stop."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TandemStub(channel)
        request = pb.GenerateRequest(
            text="Once upon a time", stopping=pb.StoppingCriteria(max_tokens=1000, ignore_eos=True)
        )
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in stub.GenerateStream(request, timeout=120):
                    if stop.is_set():
                        break


async def test_real_servers_scale_up_under_load_and_down_when_quiet(
    kmock, tiny_model_dir, tmp_path: Path
) -> None:
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    addresses = Addresses((50051, 9400))
    model = tiny_model_dir("llama")
    servers: list[ServerPod] = []

    def factory(container: dict) -> ServerPod:
        env = {e["name"]: e["value"] for e in container["env"]}
        servers.append(ServerPod(addresses.take(), model, env, tmp_path / f"server-{len(servers)}.log"))
        return servers[-1]

    try:
        async with operator_running(kmock, liveness_port=0), kubelet_running(api, factory):
            env = {"TANDEM_TELEMETRY_WINDOW_S": "2", "TANDEM_WARMUP": "false"}
            scaling = {"minReplicas": 1, "maxReplicas": 2, "metricsWindowSeconds": 2}
            spec = {
                "gpusPerPod": 0,
                "pricePerGpuHour": 1.0,
                "maxNumSeqs": 2,
                "drainSeconds": 5,
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "scaling": {**scaling, "scaleDownStabilizationSeconds": 3},
            }
            await api.create(MS, model_server("tiny", **spec))

            async def ready_pods() -> int:
                ms = await api.get(MS + "/tiny")
                return ms.get("status", {}).get("readyReplicas", 0)

            await eventually(ready_pods, timeout=180, what="the first real server ready")

            async def started() -> list[dict]:  # the pod's start as its server measured it, once
                return await events(api, "PodStarted")

            (first_start,) = await eventually(started, timeout=30, what="a PodStarted Event")
            said = first_start["message"]
            assert said.startswith("pod tiny-") and " SERVING " in said, said
            assert "after its server started" in said, said
            assert all(p in said for p in ("spawn", "weights", "kv_cache", "compile", "graph_capture")), said

            # eight streams against a server that runs two at a time: a queue
            stop = asyncio.Event()
            load = [asyncio.create_task(_stream(f"{servers[0].address}:50051", stop)) for _ in range(8)]
            try:

                async def scaled_up() -> bool:
                    dep = await api.get(api_path("apps/v1", "deployments", NS, "tiny"))
                    return dep["spec"]["replicas"] == 2

                await eventually(scaled_up, timeout=120, what="scale up under load")
                (up, *_) = await posted(api, "ScaledUp")
                assert "Saturated" in up["message"]
                await eventually(lambda: _ready_is(api, 2), timeout=180, what="2 ready")

                async def both_started() -> bool:
                    return len(await events(api, "PodStarted")) == 2

                await eventually(both_started, timeout=30, what="the second pod's PodStarted Event")
            finally:
                stop.set()
                for task in load:
                    task.cancel()
                await asyncio.gather(*load, return_exceptions=True)

            async def scaled_down() -> bool:
                dep = await api.get(api_path("apps/v1", "deployments", NS, "tiny"))
                return dep["spec"]["replicas"] == 1

            await eventually(scaled_down, timeout=120, what="scale down when quiet")
            (down, *_) = await posted(api, "ScaledDown")
            # the real servers' capacity gauge is what sizes them: spare capacity, not idle time
            assert "2 -> 1 pods (SpareCapacity)" in down["message"], down["message"]
            assert "capacity use" in down["message"]

            # at minReplicas the quiet pod holds with spare capacity, and the bounds say so
            async def limited_at_minimum() -> dict | None:
                ms = await api.get(MS + "/tiny")
                limited = condition(ms, "ScalingLimited")
                return ms if (limited.get("status"), limited.get("reason")) == ("True", "AtMinimum") else None

            ms = await eventually(limited_at_minimum, timeout=30, what="ScalingLimited True/AtMinimum")
            assert ms["status"]["lastDecision"]["reason"] == "SpareCapacity"
    finally:
        await api.close()


async def _ready_is(api: KubeApi, n: int) -> bool:
    ms = await api.get(MS + "/tiny")
    return ms.get("status", {}).get("readyReplicas") == n
