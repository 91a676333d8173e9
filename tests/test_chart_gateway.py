"""The chart's Gateway API Inference Extension objects (values `inferenceGateway`): the InferencePool
passes its API and selects exactly the pods the operator's own builders make for the ModelServer, on
their OpenAI port; the endpoint picker it names is the chart's, scrapes the port the operator gives the
pods' /metrics, reads only its pool and the pool's pods, and the network policies let it scrape. That
the metric names it is given are gauges a real server exports: test_telemetry_server.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
from inference_gateway import (
    INFERENCE_POOL,
    engine_metrics,
    parse_spec,
    picker_config,
    plugin_parameters,
)
from test_chart import CHART, KUBE_VERSIONS, NAMESPACE, RELEASE, VALUE_SETS, objects, one, render, rule_table

resources = pytest.importorskip("tandem.operator.resources", reason="the operator's builders")
spec_module = pytest.importorskip("tandem.operator.spec")
operator_settings = pytest.importorskip("tandem.operator.settings")

POOL = "smollm2"  # the example ModelServer's name in values.yaml
TWO_POOLS = {
    "operator": {"watchNamespaces": [NAMESPACE, "ml"]},
    "inferenceGateway": {
        "enabled": True,
        "modelServers": [{"name": POOL}, {"name": "llama-8b", "namespace": "ml"}],
    },
}
# docs/install.md, "Behind an inference gateway": what a picker may do, in its pool's namespace only
PICKER_RULES = {
    ("", "pods"): {"get", "list", "watch"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
    ("llm-d.ai", "inferenceobjectives"): {"get", "list", "watch"},
    ("llm-d.ai", "inferencemodelrewrites"): {"get", "list", "watch"},
    ("inference.networking.x-k8s.io", "inferenceobjectives"): {"get", "list", "watch"},
    ("inference.networking.x-k8s.io", "inferencemodelrewrites"): {"get", "list", "watch"},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def gateway(chart: helm.Chart) -> list[dict]:
    return render(chart, VALUE_SETS["gateway"])


def named(docs: list[dict], kind: str, name: str, namespace: str = NAMESPACE) -> dict:
    (found,) = [
        d
        for d in docs
        if d["kind"] == kind and d["metadata"]["name"] == name and d["metadata"]["namespace"] == namespace
    ]
    return found


def operator_pods(docs: list[dict], name: str = POOL) -> dict:
    """The pod template of the Deployment the operator would make for the rendered example."""
    example = one(docs, "ModelServer")
    spec = spec_module.parse_spec(example["spec"])
    metrics_port = operator_settings.OperatorSettings().metrics_port
    return resources.deployment(name, spec, metrics_port)["spec"]["template"]


def picker_container(docs: list[dict], pool: str = POOL, namespace: str = NAMESPACE) -> dict:
    pod = named(docs, "Deployment", f"{pool}-epp", namespace)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def flags(container: dict) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) if "=" in a else (a[2:], "") for a in container["args"])


# ---------------------------------------------------------------- the InferencePool


@pytest.mark.parametrize("values", [VALUE_SETS["gateway"], TWO_POOLS], ids=["example", "two"])
def test_pools_pass_the_inference_pool_api(chart: helm.Chart, values: dict) -> None:
    pools = objects(render(chart, values), "InferencePool")
    assert len(pools) == len(values["inferenceGateway"].get("modelServers") or [POOL])
    for pool in pools:
        jsonschema.Draft7Validator(INFERENCE_POOL).validate(pool)


def test_the_pool_check_catches_wrong_fields(gateway: list[dict]) -> None:
    """The check above is not a rubber stamp: what the API refuses fails it."""
    pool = one(gateway, "InferencePool")
    broken_specs = (
        {"selector": {"matchLabels": {}}},  # selects every pod
        {"selector": {"matchExpressions": []}},  # the API's selector has matchLabels only
        {"targetPorts": []},
        {"targetPorts": [{"number": 0}]},
        {"targetPorts": [{"port": 8000}]},
        {"appProtocol": "http"},  # not in the API before v1.4
        {"endpointPickerRef": None},  # none: required before v1.6
        {"endpointPickerRef": {"name": "smollm2-epp", "failureMode": "Open"}},
        {"endpointPickerRef": {"port": {"number": 9002}}},
        {"extensionRef": {"name": "smollm2-epp"}},  # v1alpha2's field
    )
    for broken_spec in broken_specs:
        broken = copy.deepcopy(pool)
        broken["spec"].update(broken_spec)
        broken["spec"] = {k: v for k, v in broken["spec"].items() if v is not None}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(INFERENCE_POOL).validate(broken)
    old = copy.deepcopy(pool) | {"apiVersion": "inference.networking.x-k8s.io/v1alpha2"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(INFERENCE_POOL).validate(old)


def test_the_pool_selects_the_operators_pods_on_their_openai_port(gateway: list[dict]) -> None:
    pool = one(gateway, "InferencePool")
    assert pool["metadata"]["name"] == POOL and pool["metadata"]["namespace"] == NAMESPACE
    template = operator_pods(gateway)
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    # and no other ModelServer's pods
    other = operator_pods(gateway, "llama-8b")["metadata"]["labels"]
    assert not selector.items() <= other.items()
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]] == [resources.HTTP_PORT]
    # HTTP/1.1, the OpenAI API's, is a pool's protocol when it names none (and a CRD before v1.4 has
    # no field to name one)
    assert "appProtocol" not in pool["spec"]


def test_the_pool_names_the_charts_picker(gateway: list[dict]) -> None:
    ref = one(gateway, "InferencePool")["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == VALUE_SETS["gateway"]["inferenceGateway"]["failureMode"]
    assert "kind" not in ref or ref["kind"] == "Service"
    service = named(gateway, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is gRPC
    deployment = named(gateway, "Deployment", ref["name"])
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    container = picker_container(gateway)
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container_ports[port["targetPort"]] == int(flags(container)["grpc-port"])
    # the picker serves the pool it is told, found by its group
    pool_flags = flags(container)
    assert pool_flags["pool-name"] == POOL and pool_flags["pool-namespace"] == NAMESPACE
    assert pool_flags["pool-group"] == "inference.networking.k8s.io"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == int(pool_flags["grpc-health-port"])


def test_each_model_server_gets_its_own_pool_and_picker(chart: helm.Chart) -> None:
    docs = render(chart, TWO_POOLS)
    pools = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in objects(docs, "InferencePool")}
    assert pools == {(NAMESPACE, POOL), ("ml", "llama-8b")}
    for namespace, pool in pools:
        container = picker_container(docs, pool, namespace)
        assert flags(container)["pool-name"] == pool and flags(container)["pool-namespace"] == namespace
        for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"):
            doc = named(docs, kind, f"{pool}-epp", namespace)
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
        selector = named(docs, "InferencePool", pool, namespace)["spec"]["selector"]["matchLabels"]
        assert selector == {resources.MODEL_LABEL: pool}


def test_a_pool_needs_a_model_server_that_speaks_openai(chart: helm.Chart) -> None:
    off = {"exampleModelServer": {"enabled": False}, "tests": {"target": "x.ml.svc:50051"}}
    with pytest.raises(helm.HelmRenderError, match="name the ModelServers to pool"):
        render(chart, {**off, "inferenceGateway": {"enabled": True}})
    with pytest.raises(helm.HelmRenderError, match="openaiApi must be true"):
        render(chart, {"exampleModelServer": {"openaiApi": False}, "inferenceGateway": {"enabled": True}})
    assert objects(render(chart, {}), "InferencePool") == [], "off by default"


# ---------------------------------------------------------------- the endpoint picker


def test_the_picker_scrapes_the_port_the_operator_gives_metrics(gateway: list[dict]) -> None:
    """The pool's port is the OpenAI API; /metrics is on the pods' metrics port, which the picker is
    told, over plain HTTP (the server's /metrics never speaks TLS)."""
    source = plugin_parameters(picker_config(gateway, POOL, NAMESPACE), "metrics-data-source")
    (container,) = operator_pods(gateway)["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert source == {"scheme": "http", "path": "/metrics", "port": ports["metrics"]}
    assert ports["metrics"] == operator_settings.OperatorSettings().metrics_port


def test_the_picker_reads_tandems_names_for_the_protocols_metrics(gateway: list[dict]) -> None:
    config = picker_config(gateway, POOL, NAMESPACE)
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    specs = engine_metrics(config)
    assert specs == {
        "queuedRequestsSpec": "tandem_requests_waiting",
        "runningRequestsSpec": "tandem_requests_running",
        "kvUsageSpec": "tandem_kv_cache_usage_ratio",
        "loraSpec": "",  # Tandem serves no LoRA adapters
        "cacheInfoSpec": "tandem_cache_config_info",
    }
    for spec in filter(None, specs.values()):
        assert parse_spec(spec)[0].startswith("tandem_")
    # its sources: the metrics source bound to that extractor; scorers: all in the profile
    (source,) = config["dataLayer"]["sources"]
    assert source == {
        "pluginRef": "metrics-data-source",
        "extractors": [{"pluginRef": "core-metrics-extractor"}],
    }
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    used = {p["pluginRef"] for p in profile["plugins"]}
    assert used == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} and used <= defined


def test_a_config_change_restarts_the_picker(gateway: list[dict]) -> None:
    """The picker reads its file once: its pod template carries the file's checksum."""
    import hashlib

    annotations = named(gateway, "Deployment", f"{POOL}-epp")["spec"]["template"]["metadata"]["annotations"]
    (text,) = named(gateway, "ConfigMap", f"{POOL}-epp")["data"].values()
    assert annotations["checksum/config"] == hashlib.sha256(text.removesuffix("\n").encode()).hexdigest()


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_picker_reads_only_its_pool_and_the_pools_pods(chart: helm.Chart, replicas: int) -> None:
    values = {"inferenceGateway": {"enabled": True, "endpointPicker": {"replicas": replicas}}}
    docs = render(chart, values)
    epp = f"{POOL}-epp"
    expected = dict(PICKER_RULES)
    if replicas > 1:  # a leader, elected on the Lease named after its pool
        expected[("coordination.k8s.io", "leases")] = {"create"}
        expected[("coordination.k8s.io", f"leases/epp-{NAMESPACE}-{POOL}.llm-d.ai")] = {"get", "update"}
        expected[("", "events")] = {"create", "patch"}
    assert rule_table(named(docs, "Role", epp)) == expected
    binding = named(docs, "RoleBinding", epp)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": epp}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": epp, "namespace": NAMESPACE}]
    pod = named(docs, "Deployment", epp)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == epp and pod["automountServiceAccountToken"] is True
    # nothing cluster-wide: its own /metrics ask for no token review
    default = render(chart, {})
    assert len(objects(docs, "ClusterRole")) == len(objects(default, "ClusterRole"))
    assert len(objects(docs, "ClusterRoleBinding")) == len(objects(default, "ClusterRoleBinding"))
    container = picker_container(docs)
    assert flags(container)["metrics-endpoint-auth"] == "false"
    assert ("ha-enable-leader-election" in flags(container)) is (replicas > 1)
    # elected pickers answer liveness and readiness apart: a waiting one is alive, not ready
    services = {container[p]["grpc"]["service"] for p in ("livenessProbe", "readinessProbe")}
    assert services == ({"liveness", "readiness"} if replicas > 1 else {"inference-extension"})


def test_pickers_take_the_scheduling_values(gateway: list[dict]) -> None:
    pod = named(gateway, "Deployment", f"{POOL}-epp")["spec"]["template"]["spec"]
    picker = VALUE_SETS["gateway"]["inferenceGateway"]["endpointPicker"]
    assert pod["nodeSelector"] == picker["nodeSelector"]
    assert pod["tolerations"] == picker["tolerations"]
    assert named(gateway, "Deployment", f"{POOL}-epp")["spec"]["replicas"] == picker["replicas"]


def test_network_policy_lets_the_pickers_scrape(chart: helm.Chart, gateway: list[dict]) -> None:
    picker_pod = named(gateway, "Deployment", f"{POOL}-epp")["spec"]["template"]["metadata"]["labels"]
    (policy,) = [p for p in objects(gateway, "NetworkPolicy") if p["metadata"]["name"].endswith("-servers")]
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items()
        <= operator_pods(gateway)["metadata"]["labels"].items()
    )
    (metrics_rule,) = [
        r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": 9400, "protocol": "TCP"}]
    ]
    pickers = [p for p in metrics_rule["from"] if "namespaceSelector" not in p]
    assert any(p["podSelector"]["matchLabels"].items() <= picker_pod.items() for p in pickers)
    assert picker_pod["app.kubernetes.io/instance"] == RELEASE
    # without the gateway no picker may scrape
    monitoring = render(chart, VALUE_SETS["monitoring"])
    for policy in objects(monitoring, "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            for peer in rule.get("from", []):
                labels = peer.get("podSelector", {}).get("matchLabels", {})
                assert labels.get("app.kubernetes.io/component") != "endpoint-picker"


def test_notes_name_the_pools(chart: helm.Chart) -> None:
    notes = chart.render(TWO_POOLS, name=RELEASE, namespace=NAMESPACE)["tandem/templates/NOTES.txt"]
    assert f"{NAMESPACE}/{POOL}, ml/llama-8b." in notes
    assert "kind InferencePool" in notes
    default = chart.render({}, name=RELEASE, namespace=NAMESPACE)["tandem/templates/NOTES.txt"]
    assert "InferencePool" not in default
