"""The chart's example ModelServer, turned into pods by the operator's own object builders: the
Deployment, Service and PDB the operator would create pass the Kubernetes 1.29-1.33 API schemas,
probe gRPC health on the numeric port, ask for the GPU resource named in the values, and carry the
labels the chart's monitors and network policies select."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm
import kubernetes_validate
import pytest
from test_chart import (
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    VALUE_SETS,
    crd_docs,
    objects,
    one,
    render,
    validate_custom,
)

resources = pytest.importorskip("tandem.operator.resources", reason="the operator's builders")
spec_module = pytest.importorskip("tandem.operator.spec")

GRPC_PORT = 50051
HEALTH_PORT = 50052
METRICS_PORT = 9400
HTTP_PORT = 8000  # the OpenAI-compatible API


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def owned(chart: helm.Chart, value_set: str) -> tuple[dict, dict, dict, list[dict]]:
    docs = render(chart, VALUE_SETS[value_set])
    example = one(docs, "ModelServer")
    name = example["metadata"]["name"]
    spec = spec_module.parse_spec(example["spec"])
    built = (
        resources.deployment(name, spec, METRICS_PORT),
        resources.service(name, spec, METRICS_PORT),
        resources.pod_disruption_budget(name),
    )
    return (*built, docs)


@pytest.mark.parametrize("value_set", ["default", "gpu", "cpu", "monitoring", "tls"])
def test_operator_objects_pass_the_api_schemas(chart, value_set: str) -> None:
    for obj in owned(chart, value_set)[:3]:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("value_set", ["default", "gpu", "cpu"])
def test_probes_gpus_and_image_follow_the_values(chart, value_set: str) -> None:
    deployment, _, _, docs = owned(chart, value_set)
    example = one(docs, "ModelServer")["spec"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": GRPC_PORT}, "the kubelet's gRPC probe takes a number"
    assert container["image"] == example["image"]
    assert container["args"] == ["serve"], "the server image's entrypoint is `tandem`"
    gpus = example["gpusPerPod"]
    for kind in ("requests", "limits"):
        assert container["resources"].get(kind, {}).get(example["gpuResourceName"]) == (gpus or None)


def test_monitors_and_policies_select_the_operators_pods(chart) -> None:
    deployment, service, _, docs = owned(chart, "monitoring")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for monitor in objects(docs, "PodMonitor") + objects(docs, "ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert one(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"
    ].items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT, "http": HTTP_PORT}
    for policy in objects(docs, "NetworkPolicy"):
        if policy["metadata"]["namespace"] == NAMESPACE and "servers" in policy["metadata"]["name"]:
            assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
            assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == [GRPC_PORT, METRICS_PORT]
            admitted = {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
            assert set(ports.values()) <= admitted, "every Service port is let in"
    # the helm test pod dials the Service the operator names after the ModelServer
    args = one(docs, "Pod")["spec"]["containers"][0]["args"]
    assert args[2] == f"{service['metadata']['name']}.{NAMESPACE}.svc:{GRPC_PORT}"


def test_model_pods_get_the_charts_security_defaults(chart: helm.Chart) -> None:
    deployment = owned(chart, "default")[0]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/cache", "/tmp"} <= mounts


def test_gpu_node_scheduling_and_pull_secrets_reach_the_model_pods(chart: helm.Chart) -> None:
    deployment, _, _, docs = owned(chart, "gpu")
    pod = deployment["spec"]["template"]["spec"]
    example = VALUE_SETS["gpu"]["exampleModelServer"]
    assert pod["nodeSelector"] == example["nodeSelector"]
    assert pod["tolerations"] == example["tolerations"]
    assert pod["imagePullSecrets"] == VALUE_SETS["gpu"]["imagePullSecrets"]
    default_pod = owned(chart, "default")[0]["spec"]["template"]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "imagePullSecrets"} & set(default_pod)


def test_tls_example_pods_mount_secrets_and_probe_the_health_port(chart: helm.Chart) -> None:
    deployment, service, _, docs = owned(chart, "tls")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    example = one(docs, "ModelServer")["spec"]
    secrets = {v["secret"]["secretName"]: v["name"] for v in pod["volumes"] if "secret" in v}
    tls, auth = example["tls"], example["auth"]
    assert sorted(secrets) == sorted([tls["secretName"], tls["clientCASecretName"], auth["tokenSecretName"]])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for volume in secrets.values():
        assert "subPath" not in mounts[volume], "a subPath mount never sees a renewed certificate"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {"TANDEM_TLS_CERT_FILE", "TANDEM_TLS_KEY_FILE", "TANDEM_TLS_CLIENT_CA_FILE"} <= set(env)
    assert env["TANDEM_AUTH_TOKEN_FILE"].startswith(mounts[secrets["smollm2-tokens"]]["mountPath"] + "/")
    assert env["TANDEM_REFLECTION"] == "false"
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": HEALTH_PORT}, "the kubelet's gRPC probe speaks no TLS"
    # the helm test's address leads through the Service to the server's health port
    target = one(docs, "Pod")["spec"]["containers"][0]["args"][2]
    host, port = target.rsplit(":", 1)
    assert host == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    (container_port,) = [p for p in container["ports"] if p["name"] == service_port["targetPort"]]
    assert container_port["containerPort"] == int(env["TANDEM_HEALTH_PORT"]) == HEALTH_PORT
    # and the NetworkPolicy lets the test pod reach it
    test_pod = one(docs, "Pod")["metadata"]["labels"]
    (policy,) = [p for p in objects(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-servers")]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    health = {"port": HEALTH_PORT, "protocol": "TCP"}
    health_rules = [r for r in policy["spec"]["ingress"] if health in r["ports"]]
    peers = [peer["podSelector"]["matchLabels"] for rule in health_rules for peer in rule["from"]]
    assert any(peer.items() <= test_pod.items() for peer in peers)


CACHES = {
    "emptyDir": {"emptyDir": {"sizeLimit": "50Gi", "medium": "Memory"}},
    "hostPath": {"hostPath": {"path": "/var/lib/tandem/cache"}},
    "persistentVolumeClaim": {"persistentVolumeClaim": {"claimName": "smollm2-cache"}},
}


@pytest.mark.parametrize("source", CACHES)
def test_each_cache_source_reaches_valid_model_pods(chart: helm.Chart, source: str) -> None:
    """exampleModelServer.cache becomes the ModelServer's spec.cache as given (the CRD accepts it),
    and the operator's Deployment from it, with that /cache volume, passes the API schemas."""
    docs = render(chart, {"exampleModelServer": {"cache": CACHES[source]}})
    example = one(docs, "ModelServer")
    assert example["spec"]["cache"] == CACHES[source]
    validate_custom(example, crd_docs(chart))
    spec = spec_module.parse_spec(example["spec"])
    deployment = resources.deployment(example["metadata"]["name"], spec, METRICS_PORT)
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(deployment, version, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (cache,) = [v for v in pod["volumes"] if v["name"] == "cache"]
    assert set(cache) == {"name", source}
    for key, value in CACHES[source][source].items():
        assert cache[source][key] == value


def test_the_default_values_keep_a_cache_of_each_pods_own(chart: helm.Chart) -> None:
    deployment, _, _, docs = owned(chart, "default")
    assert "cache" not in one(docs, "ModelServer")["spec"], "unset: the CRD's default"
    (cache,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
    assert cache == {"name": "cache", "emptyDir": {}}
