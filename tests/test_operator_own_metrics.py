"""The operator's own Prometheus metrics (operator/metrics.py), read over HTTP from a running
operator against kmock: the decisions it made (counted as its Events tell them), the failed
scrapes of a pod that answers bytes that are not UTF-8 and then +Inf, tick and reconcile times,
the replicas as the status shows them, the leader gauge; series of a deleted ModelServer go, no
label carries a pod name. Plus the fixed label sets, without a cluster."""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from kubelet import Addresses, MetricsPod
from prometheus_client.parser import text_string_to_metric_families
from test_operator_e2e import (
    MS,
    NS,
    declare_resources,
    events,
    eventually,
    kubelet_running,
    metrics_pods,
    model_server,
    operator_running,
)
from test_operator_scaling_modes import SATURATED, client, deployment_replicas, scale

from tandem.operator import metrics, scrape
from tandem.operator.kube import KubeApi
from tandem.operator.settings import OperatorSettings

Samples = dict[tuple[str, frozenset], float]
DECISIONS = "tandem_operator_decisions_total"
WATCHED = {"namespace": NS, "modelserver": "watched"}


async def read_metrics(port: int) -> Samples:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def served(port: int) -> Samples:
    """The first answer of an operator that is starting (it serves /metrics before kopf runs)."""
    for _ in range(100):
        try:
            return await read_metrics(port)
        except aiohttp.ClientConnectorError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"no /metrics on port {port}")


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str, **labels: str) -> dict[frozenset, float]:
    """The samples of `name` whose labels include `labels`."""
    return {k: v for (n, k), v in samples.items() if n == name and frozenset(labels.items()) <= k}


@pytest.mark.asyncio
async def test_metrics_reflect_real_decisions_and_failed_scrapes(kmock, unused_tcp_port: int) -> None:
    declare_resources(kmock)
    api = client(kmock)
    port = unused_tcp_port
    pods: list[MetricsPod] = []
    async with (
        operator_running(kmock, liveness_port=0, prometheus_port=port),
        kubelet_running(api, metrics_pods(Addresses((9400,)), pods)) as kubelet,
    ):
        assert value(await served(port), "tandem_operator_leader") == 1.0, "no election: it acts"
        scaling = {"minReplicas": 2, "maxReplicas": 3, "metricsWindowSeconds": 2}
        await api.create(MS, model_server("watched", maxNumSeqs=4, scaling=scaling))
        await eventually(lambda: len(kubelet.pods_of("watched")) == 2, what="two pods")
        bad_name, good_name = sorted(kubelet.backends)
        bad, good = kubelet.backends[bad_name], kubelet.backends[good_name]
        bad.body = b"tandem_requests_running \xff\xfe 1\n"
        for _ in range(4):  # the good pod saturated: scale up to maxReplicas, the bad one named
            good.load(**SATURATED)
            await asyncio.sleep(0.3)

        async def settled() -> Samples | None:
            """At maxReplicas, spec.replicas the policy's, the gauges what the status says, and
            the third pod ready: from then on the pod that does not report holds the others."""
            ms = await api.get(MS + "/watched")
            status = ms.get("status", {})
            samples = await read_metrics(port)
            gauges = {
                "tandem_operator_desired_replicas": status.get("desiredReplicas"),
                "tandem_operator_ready_replicas": status.get("readyReplicas"),
                "tandem_operator_replicas": status.get("replicas"),
            }
            agree = all(value(samples, n, **WATCHED) == v for n, v in gauges.items())
            at_max = status.get("replicas") == status.get("readyReplicas") == ms["spec"].get("replicas") == 3
            held = value(samples, DECISIONS, **WATCHED, action="Hold", reason="MetricsMissing")
            return (
                samples
                if agree and at_max and held and await deployment_replicas(api, "watched") == 3
                else None
            )

        samples = await eventually(settled, what="scaled up to 3, the gauges as the status")
        ups = [e for e in await events(api, "ScaledUp") if e["involvedObject"]["name"] == "watched"]
        assert ups and all("(Saturated)" in e["message"] for e in ups)
        decisions = series(samples, DECISIONS, **WATCHED)
        assert value(samples, DECISIONS, **WATCHED, action="ScaleUp", reason="Saturated") == len(ups)
        assert {dict(k)["action"] for k in decisions} <= {"ScaleUp", "Hold"}, "never down, never Other"
        failures = series(samples, "tandem_operator_scrape_failures_total", **WATCHED)
        assert {dict(k)["problem"] for k in failures} == {"NotUTF8"} and min(failures.values()) >= 1
        ticks = value(samples, "tandem_operator_tick_duration_seconds_count", mode="Operator")
        # one decision per tick at most; a tick still running has decided but is not timed yet
        assert ticks is not None and ticks >= sum(decisions.values()) - 1
        assert value(samples, "tandem_operator_reconcile_duration_seconds_count", result="Reconciled") >= 1

        # another kind of bad answer is counted under its own kind
        bad.body = b"tandem_requests_running +Inf\ntandem_requests_waiting 0\n"

        async def bad_value() -> Samples | None:
            samples = await read_metrics(port)
            kinds = {
                dict(k)["problem"]
                for k in series(samples, "tandem_operator_scrape_failures_total", **WATCHED)
            }
            return samples if "BadValue" in kinds else None

        samples = await eventually(bad_value, what="BadValue counted")
        pod_names = set(kubelet.backends)
        for _, labels in samples:
            assert not {v for _, v in labels} & pod_names, f"a pod name in a label: {labels}"

        # mode Operator: `kubectl scale` is put back, with a Warning; the Deployment never follows it
        await scale(api, "watched", 1)
        (warning,) = await eventually(lambda: events(api, "ReplicasOverridden"), what="ReplicasOverridden")
        assert (
            warning["type"] == "Warning" and "spec.replicas 1 was set by someone else" in warning["message"]
        )
        assert "spec.scaling.mode to External" in warning["message"]
        await eventually(lambda: _spec_replicas_is(api, 3), what="spec.replicas put back")
        assert await deployment_replicas(api, "watched") == 3
        assert not [e for e in await events(api, "ScaledDown") if e["involvedObject"]["name"] == "watched"]

        # a spec only a person can fix: its reconcile is counted as such
        await api.create(MS, model_server("broken", scaling={"minReplicas": 3, "maxReplicas": 2}))

        async def counted_invalid() -> bool:
            samples = await read_metrics(port)
            return (
                value(samples, "tandem_operator_reconcile_duration_seconds_count", result="InvalidSpec") or 0
            ) >= 1

        await eventually(counted_invalid, what="InvalidSpec reconcile counted")

        # deleted: the ModelServer's series go (the label sets stay bounded by the live ones)
        await api.delete(MS + "/watched")

        async def forgotten() -> bool:
            samples = await read_metrics(port)
            return not [k for _, k in samples if ("modelserver", "watched") in k]

        await eventually(forgotten, what="series of the deleted ModelServer removed")
    await api.close()


async def _spec_replicas_is(api: KubeApi, replicas: int) -> bool:
    return (await api.get(MS + "/watched"))["spec"].get("replicas") == replicas


# ---------------------------------------------------------------- the label sets, without a cluster


def _policy_reasons() -> set[str]:
    """Every one-word CamelCase string constant of policy.py: its reasons and actions."""
    source = (Path(__file__).resolve().parent.parent / "operator" / "policy.py").read_text()
    words = {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    return {w for w in words if w[:1].isupper() and w.isalpha()}


def test_every_reason_of_the_policy_is_a_label_value_of_its_own() -> None:
    """A reason added to policy.py and not to metrics.REASONS would be counted as Other."""
    found = _policy_reasons() - metrics.ACTIONS
    assert {"Saturated", "Underused", "Stabilizing", "MetricsMissing"} <= found, "the scan finds them"
    assert found <= metrics.REASONS, f"add to metrics.REASONS: {sorted(found - metrics.REASONS)}"


def _text(m: metrics.OperatorMetrics) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(m.render().decode())
        for s in family.samples
    }


def test_label_values_outside_the_fixed_sets_are_other() -> None:
    m = metrics.OperatorMetrics()
    m.decided("ml", "a", "ScaleSideways", "x" * 300)
    m.decided("ml", "a", "Hold", "Saturated")
    m.scrape_failed("ml", "a", "/metrics answered HTTP 500 for pod a-7f9c")
    m.reconciled("Whatever", 0.1)
    with m.tick("a" * 50):
        pass
    samples = _text(m)
    assert (
        value(
            samples,
            "tandem_operator_decisions_total",
            namespace="ml",
            modelserver="a",
            action="Other",
            reason="Other",
        )
        == 1
    )
    assert (
        value(
            samples,
            "tandem_operator_decisions_total",
            namespace="ml",
            modelserver="a",
            action="Hold",
            reason="Saturated",
        )
        == 1
    )
    assert (
        value(
            samples, "tandem_operator_scrape_failures_total", namespace="ml", modelserver="a", problem="Other"
        )
        == 1
    )
    assert value(samples, "tandem_operator_reconcile_duration_seconds_count", result="Error") is None
    assert value(samples, "tandem_operator_reconcile_duration_seconds_count", result="Other") == 1
    assert value(samples, "tandem_operator_tick_duration_seconds_count", mode="Other") == 1


def test_a_forgotten_modelserver_leaves_no_series_and_others_stay() -> None:
    m = metrics.OperatorMetrics()
    for name in ("a", "b"):
        m.decided("ml", name, "ScaleUp", "Saturated")
        m.scrape_failed("ml", name, scrape.TIMEOUT)
        m.observed("ml", name, replicas=2, desired=3, ready=1)
    m.forget("ml", "a")
    names = {dict(k).get("modelserver") for _, k in _text(m)}
    assert "a" not in names and "b" in names
    m.forget("ml", "never-seen")  # nothing to forget: no error


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b"tandem_requests_running \xff\xfe 1\n", scrape.NOT_UTF8),
        (b"this is { not prometheus", scrape.NOT_PROMETHEUS),
        (b"up 1\n", scrape.MISSING_METRIC),
        (b"tandem_requests_running 1\ntandem_requests_waiting -1\n", scrape.BAD_VALUE),
        (b"tandem_requests_running NaN\ntandem_requests_waiting 0\n", scrape.BAD_VALUE),
    ],
)
def test_every_unreadable_body_has_a_kind_of_the_fixed_set(body: bytes, kind: str) -> None:
    result = scrape.read_body("pod-a", 1.0, body)
    assert isinstance(result, scrape.Unreadable) and result.kind == kind
    assert kind in scrape.PROBLEM_KINDS and kind in metrics.PROBLEMS


def test_the_metrics_port_must_not_be_the_liveness_port() -> None:
    with pytest.raises(ValueError, match="prometheus_port and liveness_port are both 8080"):
        OperatorSettings(prometheus_port=8080)
    assert OperatorSettings().prometheus_port == 0, "off unless asked for (the chart asks for 8081)"


def test_a_taken_metrics_port_stops_the_operator_with_a_clear_message(unused_tcp_port: int) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", unused_tcp_port))
        taken.listen()
        tandem = Path(sys.executable).with_name("tandem")
        proc = subprocess.run(
            [str(tandem), "operator", "--prometheus-port", str(unused_tcp_port), "--liveness-port", "0"],
            capture_output=True, text=True, timeout=60, cwd="/",
            env={**os.environ, "PYTHONSAFEPATH": "1", "TANDEM_OPERATOR_API_SERVER": "http://127.0.0.1:9"},
        )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"cannot serve /metrics on port {unused_tcp_port}" in proc.stdout + proc.stderr


@pytest.mark.asyncio
async def test_served_as_prometheus_text_or_openmetrics(unused_tcp_port: int) -> None:
    m = metrics.OperatorMetrics()
    m.decided("ml", "a", "Hold", "WithinTargets")
    runner = await metrics.serve(m, unused_tcp_port)
    url = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    try:
        async with aiohttp.ClientSession() as http:
            openmetrics = {"Accept": "application/openmetrics-text; version=1.0.0"}
            async with http.get(url, headers=openmetrics) as response:
                assert response.headers["Content-Type"].startswith("application/openmetrics-text")
                assert (await response.text()).rstrip().endswith("# EOF")
            async with http.get(url) as response:
                assert response.headers["Content-Type"].startswith("text/plain")
                assert "tandem_operator_decisions_total{" in await response.text()
        with pytest.raises(metrics.MetricsPortError, match=f"port {unused_tcp_port}"):
            await metrics.serve(m, unused_tcp_port)  # taken by the first
    finally:
        await runner.cleanup()
