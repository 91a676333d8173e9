"""Who scales a ModelServer (spec.scaling.mode), end to end against kmock with the test's kubelet:
in mode External the Deployment follows spec.replicas, set through the scale subresource as
`kubectl scale`, an HPA or KEDA would, within the bounds, and the operator scrapes no pod and
makes no decision of its own; back in mode Operator the policy decides again and writes each
decision to spec.replicas. Plus the pure rules behind it (operator/modes.py)."""

from __future__ import annotations

import asyncio
import time

import kopf
import pytest
from kubelet import Addresses, MetricsPod
from test_operator_e2e import (
    MS,
    NS,
    condition,
    declare_resources,
    events,
    eventually,
    kubelet_running,
    metrics_pods,
    model_server,
    operator_running,
    posted,
)

from tandem.operator import modes
from tandem.operator.kube import KubeApi, api_path
from tandem.operator.spec import InvalidSpec, parse_spec

SATURATED = {"running": 4, "waiting": 6, "kv": 0.9, "idle": 0.0, "tokens": 400, "ttft": 2.0}


def client(kmock) -> KubeApi:
    return KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))


async def deployment_replicas(api: KubeApi, name: str) -> int:
    return (await api.get(api_path("apps/v1", "deployments", NS, name)))["spec"]["replicas"]


async def scale(api: KubeApi, name: str, replicas: int) -> None:
    """`kubectl scale modelserver NAME --replicas=N`: a patch of the scale subresource, which the
    API server applies to spec.replicas (the CRD's specReplicasPath; kmock: onto the object)."""
    await api.patch(f"{MS}/{name}/scale", {"spec": {"replicas": replicas}})


def service_patches(kmock) -> int:
    """How often the reconcile handler brought the Service to shape (owned.ensure patches it)."""
    return sum(
        1
        for r in list(kmock)
        if r.method.value == "PATCH" and r.url.path == f"/api/v1/namespaces/{NS}/services/ext"
    )


async def quiet_service_patches(kmock, for_s: float = 2.0) -> int:
    """The count once it stood still for `for_s`: on kmock, kopf reconciles again for each event
    queued before its own patch after a creation (kmock never moves resourceVersion), and on a
    loaded machine that backlog takes a while to drain."""
    count, since = service_patches(kmock), time.monotonic()
    deadline = since + 60
    while time.monotonic() - since < for_s:
        assert time.monotonic() < deadline, "the reconciles after the creation never ended"
        await asyncio.sleep(0.2)
        if (now := service_patches(kmock)) != count:
            count, since = now, time.monotonic()
    return count


@pytest.mark.asyncio
async def test_external_mode_follows_spec_replicas_and_never_decides(kmock) -> None:
    declare_resources(kmock)
    api = client(kmock)
    pods: list[MetricsPod] = []
    async with (
        operator_running(kmock, liveness_port=0),
        kubelet_running(api, metrics_pods(Addresses((9400,)), pods)) as kubelet,
    ):
        scaling = {"mode": "External", "minReplicas": 1, "maxReplicas": 3, "metricsWindowSeconds": 2}
        await api.create(MS, model_server("ext", maxNumSeqs=4, scaling=scaling))

        async def following(replicas: int) -> dict | None:
            ms = await api.get(MS + "/ext")
            status = ms.get("status", {})
            done = status.get("replicas") == status.get("desiredReplicas") == replicas
            return ms if done and await deployment_replicas(api, "ext") == replicas else None

        # spec.replicas unset: the operator writes the pods it runs (an HPA reads it through the
        # scale subresource), and the pods' label selector for the HPA
        ms = await eventually(lambda: following(1), what="first External tick")
        assert ms["spec"]["replicas"] == 1
        assert ms["status"]["selector"] == "tandem.dev/modelserver=ext"
        active = condition(ms, "ScalingActive")
        assert (active["status"], active["reason"]) == ("False", "ExternalScaler")
        assert "spec.replicas (1)" in active["message"]
        assert condition(ms, "MetricsAvailable")["status"] == "Unknown"
        assert ms["status"]["lastDecision"]["reason"] == "ExternalScaler"

        # saturated pods scale up at once in mode Operator; here nothing moves, nothing is scraped
        await eventually(lambda: len(pods) == 1, what="first pod")
        for _ in range(6):  # twelve ticks
            pods[0].load(**SATURATED)
            await asyncio.sleep(0.5)
        assert await deployment_replicas(api, "ext") == 1
        assert pods[0].requests == 0, "a pod of an External ModelServer is never scraped"
        assert await events(api, "ScaledUp") == []

        # kubectl scale --replicas=3: followed, with an Event naming the external scaler; a change
        # of spec.replicas alone re-makes none of the owned objects (they hold no replicas)
        updates = await quiet_service_patches(kmock)
        await scale(api, "ext", 3)
        ms = await eventually(lambda: following(3), what="scaled to spec.replicas 3")
        assert service_patches(kmock) == updates
        (up,) = await posted(api, "ScaledUp")
        assert "1 -> 3 pods (ExternalScaler): spec.replicas 3" in up["message"]
        assert ms["status"]["lastDecision"]["action"] in ("ScaleUp", "Hold")
        assert condition(ms, "ScalingLimited")["reason"] == "WithinBounds"
        await eventually(lambda: len(kubelet.pods_of("ext")) == 3, what="three pods")

        # beyond maxReplicas the bounds hold, and say so; KEDA's scale to zero runs minReplicas
        await scale(api, "ext", 10)

        async def limited(reason: str) -> dict | None:
            ms = await api.get(MS + "/ext")
            return ms if condition(ms, "ScalingLimited").get("reason") == reason else None

        ms = await eventually(lambda: limited("AtMaximum"), what="AtMaximum")
        assert (
            "spec.replicas 10 is above maxReplicas 3: running 3" in condition(ms, "ScalingLimited")["message"]
        )
        assert await deployment_replicas(api, "ext") == 3
        await scale(api, "ext", 0)
        ms = await eventually(lambda: limited("AtMinimum"), what="AtMinimum")
        assert await eventually(lambda: following(1), what="down to minReplicas")
        assert ms["spec"]["replicas"] == 0, "the operator never rewrites what the external scaler wrote"
        assert sum(p.requests for p in pods) == 0
        assert not [
            e
            for e in await events(api, "ScaledUp") + await events(api, "ScaledDown")
            if "ExternalScaler" not in e["message"]
        ]

        # back to mode Operator with saturated pods: the policy decides again (it scrapes, scales on
        # Saturated) and its decisions are spec.replicas
        await scale(api, "ext", 2)
        await eventually(lambda: following(2), what="two pods")
        await eventually(lambda: len(kubelet.pods_of("ext")) == 2, what="two pods left")
        await api.patch(MS + "/ext", {"spec": {"scaling": {"mode": "Operator"}}})

        async def policy_scaled_up() -> bool:
            for pod in kubelet.pods_of("ext"):
                pod.load(**SATURATED)
            return any("(Saturated)" in e["message"] for e in await events(api, "ScaledUp"))

        await eventually(policy_scaled_up, what="the policy's own scale-up")
        assert sum(p.requests for p in pods) > 0, "scraped again"

        async def mirrored() -> dict | None:
            ms = await api.get(MS + "/ext")
            running = await deployment_replicas(api, "ext")
            # the condition is written with the status, after the scale itself: wait for both
            active = condition(ms, "ScalingActive").get("reason") != "ExternalScaler"
            return ms if ms["spec"]["replicas"] == running == 3 and active else None

        ms = await eventually(mirrored, what="spec.replicas is the policy's decision, and it says so")
        assert condition(ms, "ScalingActive")["reason"] != "ExternalScaler"

        async def reporting() -> bool:
            return condition(await api.get(MS + "/ext"), "MetricsAvailable").get("status") == "True"

        await eventually(reporting, what="MetricsAvailable again")  # the third pod may be starting
    await api.close()


# ---------------------------------------------------------------- the rules, without a cluster


def test_mode_and_replicas_in_the_spec() -> None:
    spec = parse_spec({"image": "x"})
    assert (spec.scaling.mode, spec.replicas) == ("Operator", None)
    spec = parse_spec({"image": "x", "replicas": 0, "scaling": {"mode": "External", "minReplicas": 2}})
    assert (spec.scaling.mode, spec.replicas, spec.initial_replicas()) == ("External", 0, 2)
    assert parse_spec({"image": "x", "replicas": 9, "scaling": {"maxReplicas": 5}}).initial_replicas() == 5
    with pytest.raises(InvalidSpec, match="spec.scaling.mode"):
        parse_spec({"image": "x", "scaling": {"mode": "HPA"}})
    with pytest.raises(InvalidSpec, match="spec.replicas"):
        parse_spec({"image": "x", "replicas": -1})


def test_mode_of_an_unparsed_body_is_one_of_two_words() -> None:
    """It labels a metric before the spec is checked: never an arbitrary string."""
    assert modes.mode_of({"spec": {"scaling": {"mode": "External"}}}) == "External"
    for body in ({}, {"spec": None}, {"spec": {"scaling": "x"}}, {"spec": {"scaling": {"mode": "a" * 500}}}):
        assert modes.mode_of(body) == "Operator"


def test_someone_elses_spec_replicas_is_told_from_the_operators_own() -> None:
    assert not modes.overridden(None, running=3, claimed=None), "unset: the operator writes it, no Warning"
    assert not modes.overridden(3, running=3, claimed=2)
    assert modes.overridden(1, running=3, claimed=3), "kubectl scale while the policy runs 3"
    # the Deployment was scaled by hand: spec.replicas is still the operator's, the policy goes on
    assert not modes.overridden(3, running=5, claimed=3)


def test_the_newer_spec_wins_and_a_tie_goes_to_the_status_writes_answer() -> None:
    old, new = {"metadata": {"generation": 4}}, {"metadata": {"generation": 5}}
    assert modes.newest(old, new) is new and modes.newest(new, old) is new
    assert modes.newest(None, old) is old
    same = {"metadata": {"generation": 4}}
    assert modes.newest(old, same) is old, "kmock never moves generation: the operator's own answer"


def test_external_mode_drops_the_observations_of_scrapes() -> None:
    status = {"replicas": 2, "idleFraction": 0.5, "costPerMillionTokensUsd": 1.0, "selector": "a=b", "x": 1}
    assert modes.stale_observations(status) == {
        "idleFraction": None,
        "costPerMillionTokensUsd": None,
        "x": None,
    }


@pytest.mark.parametrize(
    ("wanted", "target", "reason", "message"),
    [
        (2, 2, "WithinBounds", "bounds 1-3"),
        (7, 3, "AtMaximum", "spec.replicas 7 is above maxReplicas 3: running 3"),
        (0, 1, "AtMinimum", "spec.replicas 0 is below minReplicas 1: running 1"),
    ],
)
def test_external_conditions(wanted: int, target: int, reason: str, message: str) -> None:
    spec = parse_spec({"image": "x", "replicas": wanted, "scaling": {"mode": "External", "maxReplicas": 3}})
    old = [{"type": "SpecAdjusted", "status": "True", "reason": "MetricsWindowClamped"}]
    body = {"metadata": {"name": "m", "generation": 3}, "status": {"conditions": old}}
    conditions = {c["type"]: c for c in modes.external_conditions(body, spec, wanted, target, ready=target)}
    assert set(conditions) == {"Ready", "ScalingActive", "ScalingLimited", "MetricsAvailable"}
    assert (
        conditions["ScalingLimited"]["reason"] == reason
        and conditions["ScalingLimited"]["message"] == message
    )
    assert conditions["ScalingLimited"]["status"] == ("False" if reason == "WithinBounds" else "True")
    assert conditions["ScalingActive"]["status"] == "False" and conditions["Ready"]["status"] == "True"
    assert all(c["observedGeneration"] == 3 for c in conditions.values())
    status = modes.external_status(body, spec, wanted, current=1, target=target, ready=target, now=0.0)
    assert status["lastDecision"]["action"] == ("ScaleUp" if target > 1 else "Hold")
    assert ("lastScaleTime" in status) == (target != 1)
    assert status["selector"] == "tandem.dev/modelserver=m"
