"""The operator end to end against kmock (an in-memory Kubernetes API on a real HTTP port).

The operator runs in this process (kopf, the real handlers, the real policy); the test plays
the controllers kmock lacks (tests/kubelet.py): Deployment replicas become Pod objects backed by
servers on their own 127.0.0.N addresses, whose /metrics the operator scrapes over real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kopf
import pytest
from kubelet import Addresses, Kubelet, MetricsPod

from tandem.operator.kube import KubeApi, NotFound, api_path
from tandem.operator.main import run_operator
from tandem.operator.settings import OperatorSettings

pytestmark = pytest.mark.asyncio

NS = "ml"
MS = api_path("tandem.dev/v1alpha1", "modelservers", NS)


def declare_resources(kmock: Any) -> None:
    kmock.resources.load_bundled()  # the built-in APIs: namespaces, CRDs, pods, apps, policy, events
    kmock.resources["tandem.dev/v1alpha1/modelservers"] = kmock.ResourceInfo(
        kind="ModelServer",
        singular="modelserver",
        namespaced=True,
        shortnames={"ms", "tms"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},  # as the CRD: /scale writes spec.replicas (kmock: onto the object)
    )


def model_server(name: str, **spec: Any) -> dict:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ModelServer",
        # kmock assigns no resourceVersion; kopf's patches need one
        "metadata": {
            "name": name,
            "namespace": NS,
            "resourceVersion": "1",
            "uid": f"uid-{name}",
            "generation": 1,
        },
        "spec": {"image": "tandem:test", **spec},
    }


async def eventually(probe: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    """Poll an async probe until it returns something truthy (the test's only use of time)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(NotFound):
            last = probe()
            if inspect.isawaitable(last):
                last = await last
            if last:
                return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what} (last: {last!r})")


@contextlib.asynccontextmanager
async def operator_running(kmock: Any, **overrides: Any) -> AsyncIterator[OperatorSettings]:
    fast = {"scrape_interval_s": 0.5, "scrape_timeout_s": 2.0, "stale_after_s": 10.0}
    settings = OperatorSettings(api_server=str(kmock.url).rstrip("/"), **{**fast, **overrides})
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(settings, stop_flag=stop))
    try:
        yield settings
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def kubelet_running(api: KubeApi, factory: Callable) -> AsyncIterator[Kubelet]:
    kubelet = Kubelet(api, NS, factory)
    stop = asyncio.Event()
    task = asyncio.create_task(kubelet.run(stop))
    try:
        yield kubelet
    finally:
        stop.set()
        await task
        await kubelet.shutdown()


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


async def events(api: KubeApi, reason: str) -> list[dict]:
    return [e for e in await api.list(api_path("v1", "events", NS)) if e.get("reason") == reason]


async def posted(api: KubeApi, reason: str, timeout: float = 30.0) -> list[dict]:
    """The Events of `reason` once there is one: the operator posts an Event after the change it
    reports (the Deployment scaled, the status written), so a test that saw the change waits for it."""
    return await eventually(lambda: events(api, reason), timeout=timeout, what=f"a {reason} Event")


async def test_modelserver_lifecycle_scales_with_load(kmock, unused_tcp_port: int) -> None:
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    addresses = Addresses((9400,))
    pods: list[MetricsPod] = []

    def factory(container: dict) -> MetricsPod:
        metrics_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
        pods.append(MetricsPod(addresses.take(), metrics_port))
        return pods[-1]

    async with operator_running(kmock, liveness_port=unused_tcp_port), kubelet_running(api, factory):
        spec = {
            "pricePerGpuHour": 2.0,
            "maxNumSeqs": 4,
            "drainSeconds": 120,
            "scaling": {
                "minReplicas": 1,
                "maxReplicas": 3,
                "metricsWindowSeconds": 2,
                "scaleDownStabilizationSeconds": 3,
                "targetTimeToFirstTokenSeconds": 1.0,
            },
        }
        ms = await api.create(MS, model_server("llama", **spec))

        # the owned objects, with their shape
        dep = await eventually(
            lambda: api.get(api_path("apps/v1", "deployments", NS, "llama")), what="Deployment"
        )
        svc = await eventually(lambda: api.get(api_path("v1", "services", NS, "llama")), what="Service")
        pdb = await eventually(
            lambda: api.get(api_path("policy/v1", "poddisruptionbudgets", NS, "llama")), what="PDB"
        )
        for obj in (dep, svc, pdb):
            (owner,) = obj["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
                "ModelServer", "llama", ms["metadata"]["uid"], True,
            )  # fmt: skip
        pod_spec = dep["spec"]["template"]["spec"]
        (container,) = pod_spec["containers"]
        assert container["readinessProbe"]["grpc"] == {"port": 50051}
        assert container["startupProbe"]["grpc"] == {"port": 50051}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 9400}
        assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert pod_spec["terminationGracePeriodSeconds"] > 120
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["TANDEM_MAX_NUM_SEQS"] == "4" and env["TANDEM_DRAIN_TIMEOUT_S"] == "120"
        assert env["TANDEM_PRICE_PER_GPU_HOUR"] == "2.0"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert dep["spec"]["replicas"] == 1
        ports = {(p["name"], p["port"]) for p in svc["spec"]["ports"]}
        assert ports == {("grpc", 50051), ("http", 8000), ("metrics", 9400)}  # spec.openaiApi: on by default
        assert (
            svc["spec"]["selector"]
            == dep["spec"]["selector"]["matchLabels"]
            == pdb["spec"]["selector"]["matchLabels"]
        )
        assert pdb["spec"]["maxUnavailable"] == 1

        # liveness endpoint
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{unused_tcp_port}/healthz") as response:
                assert response.status == 200

        # one pod, ready and quiet but busy enough to hold: the operator holds
        await eventually(lambda: len(pods) == 1 and pods, what="first pod")
        pods[0].load(running=2, waiting=0, kv=0.2, idle=0.0, tokens=100, ttft=0.05)
        got = await eventually(lambda: _status_has(api, "readyReplicas", 1), what="ready")
        assert condition(got, "Ready")["status"] == "True"

        # saturation: a queue and a full batch -> scale up, with an Event and the reason
        for _ in range(6):
            pods[0].load(running=4, waiting=6, kv=0.9, idle=0.0, tokens=400, ttft=2.0)
            await asyncio.sleep(0.3)
        dep = await eventually(lambda: _replicas_at_least(api, 2), what="scale up to 2+ replicas")
        (up, *_) = await posted(api, "ScaledUp")
        assert (
            up["involvedObject"]["name"] == "llama"
            and "1 -> " in up["message"]
            and "Saturated" in up["message"]
        )
        ms = await api.get(MS + "/llama")
        assert ms["status"]["lastScaleTime"] and ms["status"]["desiredReplicas"] >= 2

        # quiet: every pod idle -> back to minReplicas after the scale-down window
        await eventually(lambda: len(pods) >= 2, what="second pod started")

        async def quiet_and_scaled_down() -> bool:
            for pod in list(pods):
                pod.load(running=0, waiting=0, kv=0.0, idle=1.0, tokens=0, ttft=0.05)
            dep = await api.get(api_path("apps/v1", "deployments", NS, "llama"))
            return dep["spec"]["replicas"] == 1

        await eventually(quiet_and_scaled_down, timeout=60, what="scale down to 1")
        downs = await posted(api, "ScaledDown")
        assert downs and all(e["type"] == "Normal" for e in downs)
        assert any("(Underused)" in e["message"] for e in downs)
        ms = await eventually(lambda: _status_has(api, "replicas", 1), what="status replicas 1")
        assert ms["status"]["idleFraction"] == 1.0 and ms["status"]["requestsRunning"] == 0

        # a spec change reaches the Deployment in place; the replica count stays the scaler's
        await api.patch(MS + "/llama", {"spec": {"image": "tandem:v2"}, "metadata": {"generation": 2}})

        async def rolled() -> bool:
            dep = await api.get(api_path("apps/v1", "deployments", NS, "llama"))
            return dep["spec"]["template"]["spec"]["containers"][0]["image"] == "tandem:v2" and dep

        dep = await eventually(rolled, what="Deployment updated")
        assert dep["spec"]["replicas"] == 1

        # delete: the ModelServer goes at once (no finalizer); the garbage collector (the test's
        # kubelet) takes the owned objects by their owner references' uid
        await api.delete(MS + "/llama")
        for path in (
            api_path("apps/v1", "deployments", NS, "llama"),
            api_path("v1", "services", NS, "llama"),
            api_path("policy/v1", "poddisruptionbudgets", NS, "llama"),
            MS + "/llama",
        ):
            await eventually(lambda path=path: _gone(api, path), what=f"{path} deleted")
    await api.close()


async def _status_has(api: KubeApi, key: str, value: Any) -> dict | None:
    ms = await api.get(MS + "/llama")
    return ms if ms.get("status", {}).get(key) == value else None


async def _replicas_at_least(api: KubeApi, n: int) -> dict | None:
    dep = await api.get(api_path("apps/v1", "deployments", NS, "llama"))
    return dep if dep["spec"]["replicas"] >= n else None


async def _gone(api: KubeApi, path: str) -> bool:
    try:
        await api.get(path)
    except NotFound:
        return True
    return False


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"scaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas 5 > maxReplicas 2"),
        ({"pricePerGpuHour": -1.5}, "spec.pricePerGpuHour"),
    ],
)
async def test_bad_spec_gets_a_condition_not_a_crash_loop(kmock, spec: dict, problem: str) -> None:
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    async with operator_running(kmock, liveness_port=0):
        await api.create(MS, model_server("bad", **spec))

        async def invalid() -> dict | None:
            ms = await api.get(MS + "/bad")
            return ms if condition(ms, "Ready").get("reason") == "InvalidSpec" else None

        ms = await eventually(invalid, what="InvalidSpec condition")
        ready = condition(ms, "Ready")
        assert ready["status"] == "False" and problem in ready["message"]
        with pytest.raises(NotFound):
            await api.get(api_path("apps/v1", "deployments", NS, "bad"))
        assert await events(api, "InvalidSpec")

        # fixed by a person: the operator carries on
        fixed = {"scaling": {"minReplicas": 1, "maxReplicas": 2}, "pricePerGpuHour": 1.0}
        await api.patch(MS + "/bad", {"spec": fixed, "metadata": {"generation": 2}})
        await eventually(lambda: api.get(api_path("apps/v1", "deployments", NS, "bad")), what="Deployment")
    await api.close()


async def test_quantization_and_kv_cache_dtype_reach_the_pods_and_a_change_rolls_them(kmock) -> None:
    """spec.quantization and spec.kvCacheDtype become the server's environment; changing them changes
    the Deployment's pod template, which rolls the pods as any other spec change does."""
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    deployment = api_path("apps/v1", "deployments", NS, "fp8")

    def env_of(dep: dict) -> dict[str, str]:
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e["value"] for e in container["env"]}

    async def env_with(wanted: dict[str, str | None]) -> dict | None:
        env = env_of(await api.get(deployment))
        return env if all(env.get(k) == v for k, v in wanted.items()) else None

    async with operator_running(kmock, liveness_port=0):
        await api.create(MS, model_server("fp8", quantization="fp8", kvCacheDtype="fp8", gpusPerPod=0))
        await eventually(
            lambda: env_with({"TANDEM_QUANTIZATION": "fp8", "TANDEM_KV_CACHE_DTYPE": "fp8"}),
            what="FP8 settings in the pod template",
        )
        # back to bf16 weights as the checkpoint is, FP8 K/V kept; then the KV cache back to the model's
        await api.patch(MS + "/fp8", {"spec": {"quantization": None}, "metadata": {"generation": 2}})
        await eventually(
            lambda: env_with({"TANDEM_QUANTIZATION": None, "TANDEM_KV_CACHE_DTYPE": "fp8"}),
            what="quantization removed from the pod template",
        )
        await api.patch(MS + "/fp8", {"spec": {"kvCacheDtype": "auto"}, "metadata": {"generation": 3}})
        await eventually(
            lambda: env_with({"TANDEM_QUANTIZATION": None, "TANDEM_KV_CACHE_DTYPE": None}),
            what="the KV-cache dtype back to the server's default",
        )
    await api.close()


async def test_a_cache_source_change_replaces_the_cache_volume(kmock) -> None:
    """spec.cache moves /cache from one source to another: the Deployment's cache volume holds only
    the new one (a volume with two sources would be refused by the API server), and back to unset it
    is the emptyDir of before."""
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    deployment = api_path("apps/v1", "deployments", NS, "cached")

    async def cache_volume_is(wanted: dict) -> bool:
        pod = (await api.get(deployment))["spec"]["template"]["spec"]
        return [v for v in pod["volumes"] if v["name"] == "cache"] == [{"name": "cache", **wanted}]

    claim = {"persistentVolumeClaim": {"claimName": "cached-cache"}}
    host = {"hostPath": {"path": "/var/lib/tandem/cache"}}
    async with operator_running(kmock, liveness_port=0):
        await api.create(MS, model_server("cached", gpusPerPod=0, cache=claim))
        await eventually(lambda: cache_volume_is(claim), what="the claim as the cache volume")
        await api.patch(MS + "/cached", {"spec": {"cache": None}, "metadata": {"generation": 2}})
        await api.patch(MS + "/cached", {"spec": {"cache": host}, "metadata": {"generation": 3}})
        wanted = {"hostPath": {**host["hostPath"], "type": "DirectoryOrCreate"}}
        await eventually(lambda: cache_volume_is(wanted), what="the node directory as the cache volume")
        await api.patch(MS + "/cached", {"spec": {"cache": None}, "metadata": {"generation": 4}})
        await eventually(lambda: cache_volume_is({"emptyDir": {}}), what="the emptyDir back")
    await api.close()


def metrics_pods(addresses: Addresses, pods: list[MetricsPod]) -> Callable[[dict], MetricsPod]:
    def factory(container: dict) -> MetricsPod:
        metrics_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
        pods.append(MetricsPod(addresses.take(), metrics_port))
        return pods[-1]

    return factory


async def test_a_pod_with_a_bad_body_is_named_and_the_others_still_count(kmock) -> None:
    """One pod answers bytes that are not UTF-8, then a +Inf gauge: it is named in MetricsAvailable,
    the decisions go on, and the other pod's saturation still scales up."""
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    pods: list[MetricsPod] = []
    factory = metrics_pods(Addresses((9400,)), pods)
    async with operator_running(kmock, liveness_port=0), kubelet_running(api, factory) as kubelet:
        scaling = {"minReplicas": 2, "maxReplicas": 3, "metricsWindowSeconds": 2}
        await api.create(MS, model_server("mixed", maxNumSeqs=4, scaling=scaling))
        await eventually(lambda: len(pods) == 2, what="two pods")
        bad_name, good_name = sorted(kubelet.backends)
        bad, good = kubelet.backends[bad_name], kubelet.backends[good_name]
        bad.body = b"tandem_requests_running \xff\xfe 1\n"
        good.load(running=1, waiting=0, kv=0.2, idle=0.0, tokens=50, ttft=0.05)

        async def named(problem: str) -> dict | None:
            ms = await api.get(MS + "/mixed")
            metrics = condition(ms, "MetricsAvailable")
            return ms if metrics.get("status") == "False" and problem in metrics.get("message", "") else None

        ms = await eventually(lambda: named(f"{bad_name}: /metrics body is not UTF-8"), what="bad pod named")
        assert good_name not in condition(ms, "MetricsAvailable")["message"]
        assert condition(ms, "Ready")["status"] == "True", "the pods are ready; one does not report"
        assert ms["status"]["lastDecision"]["reason"] == "MetricsMissing"
        assert "1 of 2 ready pods not reporting" in ms["status"]["lastDecision"]["message"]

        bad.body = b"tandem_requests_running +Inf\ntandem_requests_waiting 0\n"
        await eventually(lambda: named(f"{bad_name}: tandem_requests_running is inf"), what="+Inf named")
        for _ in range(4):  # the good pod saturated: its queue alone asks for a third pod
            good.load(running=4, waiting=6, kv=0.9, idle=0.0, tokens=400, ttft=2.0)
            await asyncio.sleep(0.3)
        await eventually(lambda: _replicas_of(api, "mixed", 3), what="scale up on the good pod's signals")
    await api.close()


async def _replicas_of(api: KubeApi, name: str, n: int) -> bool:
    dep = await api.get(api_path("apps/v1", "deployments", NS, name))
    return dep["spec"]["replicas"] == n


async def test_objects_it_does_not_own_are_never_adopted_or_deleted(kmock) -> None:
    """A Deployment of the ModelServer's name that someone else runs: not patched, not scaled, not
    deleted with the ModelServer; Ready=False NotOwned and a Warning Event say why."""
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    theirs = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "taken", "namespace": NS, "resourceVersion": "1", "labels": {"app": "theirs"}},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "theirs"}},
            "template": {
                "metadata": {"labels": {"app": "theirs"}},
                "spec": {"containers": [{"name": "web", "image": "theirs:1"}]},
            },
        },
    }
    deployment = api_path("apps/v1", "deployments", NS, "taken")
    await api.create(api_path("apps/v1", "deployments", NS), theirs)
    async with operator_running(kmock, liveness_port=0):
        await api.create(MS, model_server("taken"))

        async def refused() -> dict | None:
            ms = await api.get(MS + "/taken")
            return ms if condition(ms, "Ready").get("reason") == "NotOwned" else None

        ms = await eventually(refused, what="NotOwned condition")
        ready = condition(ms, "Ready")
        assert ready["status"] == "False" and "Deployment ml/taken" in ready["message"]
        assert condition(ms, "ScalingActive")["reason"] == "NotOwned"
        (warning,) = await posted(api, "NotOwned")
        assert warning["type"] == "Warning" and warning["involvedObject"]["name"] == "taken"
        # nothing of theirs changed, nothing of ours made beside it
        await asyncio.sleep(1.5)  # several scaling ticks
        dep = await api.get(deployment)
        assert dep["spec"] == theirs["spec"] and "ownerReferences" not in dep["metadata"]
        assert dep["metadata"]["labels"] == {"app": "theirs"}
        for path in (
            api_path("v1", "services", NS, "taken"),
            api_path("policy/v1", "poddisruptionbudgets", NS, "taken"),
        ):
            with pytest.raises(NotFound):
                await api.get(path)
        assert len(await events(api, "NotOwned")) == 1, "one Warning, not one per tick"

        await api.delete(MS + "/taken")
        await eventually(lambda: _gone(api, MS + "/taken"), what="ModelServer deleted")
        await asyncio.sleep(1.0)
        assert (await api.get(deployment))["spec"] == theirs["spec"], "never deleted with the ModelServer"
    await api.close()


async def test_deletion_needs_no_operator_and_old_finalizers_go(kmock) -> None:
    """No finalizer on ModelServers: deleting one with the operator down is immediate (the owner
    references let the garbage collector take its objects); the finalizer of earlier versions is
    removed by the operator when it sees an object, also from one stuck in deletion."""
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    legacy = model_server("legacy")
    legacy["metadata"]["finalizers"] = ["tandem.dev/operator"]
    stuck = model_server("stuck")
    stuck["metadata"]["finalizers"] = ["tandem.dev/operator"]
    await api.create(MS, legacy)
    await api.create(MS, stuck)
    await api.delete(MS + "/stuck")  # deleted while no operator runs: Terminating on the finalizer
    assert (await api.get(MS + "/stuck"))["metadata"]["deletionTimestamp"]

    async def no_finalizers(name: str) -> bool:
        return not (await api.get(MS + f"/{name}"))["metadata"].get("finalizers")

    pods: list[MetricsPod] = []
    async with operator_running(kmock, liveness_port=0):
        async with kubelet_running(api, metrics_pods(Addresses((9400,)), pods)):
            await eventually(lambda: _gone(api, MS + "/stuck"), what="stuck ModelServer released")
            await eventually(lambda: no_finalizers("legacy"), what="old finalizer removed")
            await api.create(MS, model_server("fresh"))
            await eventually(
                lambda: api.get(api_path("apps/v1", "deployments", NS, "fresh")), what="Deployment"
            )
            await asyncio.sleep(1.0)  # several scaling ticks: still no finalizer
            assert await no_finalizers("fresh")
    await api.close()
    # The operator is gone (kopf cancels the tasks made while it ran, kmock's connections too:
    # a new client). Deleting the ModelServer does not wait for it.
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    await api.delete(MS + "/fresh")
    assert await _gone(api, MS + "/fresh")
    async with kubelet_running(api, metrics_pods(Addresses((9400,)), pods)):
        await eventually(
            lambda: _gone(api, api_path("apps/v1", "deployments", NS, "fresh")),
            what="the garbage collector takes the Deployment",
        )
    await api.close()


async def test_a_metrics_window_shorter_than_two_scrapes_is_raised_and_said(kmock) -> None:
    """metricsWindowSeconds 1 with a scrape every 1.5 s would hold one scrape per pod (no rate, no
    cost, no TTFT): the operator uses 3 s and says so in SpecAdjusted and a Warning Event."""
    declare_resources(kmock)
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    async with operator_running(kmock, liveness_port=0, scrape_interval_s=1.5):
        await api.create(MS, model_server("short", scaling={"metricsWindowSeconds": 1}))

        async def adjusted() -> dict | None:
            ms = await api.get(MS + "/short")
            return ms if condition(ms, "SpecAdjusted").get("reason") == "MetricsWindowClamped" else None

        ms = await eventually(adjusted, what="SpecAdjusted condition")
        assert condition(ms, "SpecAdjusted")["status"] == "True"
        assert "using 3 s" in condition(ms, "SpecAdjusted")["message"]
        (warning,) = await posted(api, "MetricsWindowClamped")
        assert warning["type"] == "Warning" and "metricsWindowSeconds 1" in warning["message"]
    await api.close()
