"""The Helm chart, rendered and linted by Helm's own Go code (helm-python-sdk), every manifest and
CRD validated against the Kubernetes 1.29-1.33 API schemas (kubernetes-validate), custom resources
against the chart's CRDs, and the helm test pod's command run against live gRPC health services."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "tandem"
KUBE_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
RELEASE, NAMESPACE = "tandem", "tandem-system"

H200_ONLY = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H200"]}
H200_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [H200_ONLY]}]
        }
    }
}
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
CLIENTS = {"podSelector": {"matchLabels": {"tandem.dev/client": "true"}}}

VALUE_SETS: dict[str, dict] = {
    "default": {},
    "gpu": {
        "imagePullSecrets": [{"name": "regcred"}],
        "server": {
            "image": {
                "repository": "registry.example.com/ml/tandem-server",
                "tag": "0.1.0",
                "digest": "sha256:" + "ab" * 32,
                "pullPolicy": "Always",
            }
        },
        "exampleModelServer": {
            "name": "llama-8b",
            "model": {
                "source": "/models/Llama-3.1-8B-Instruct",
                "name": "llama-3.1-8b-instruct",
                "persistentVolumeClaim": "models",
                "mountPath": "/models",
            },
            "gpusPerPod": 1,
            "gpuResourceName": "nvidia.com/mig-3g.71gb",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "pricePerGpuHour": 3.5,
            "env": [{"name": "TANDEM_MAX_MODEL_LEN", "value": "8192"}],
            "maxNumSeqs": 128,
            "drainSeconds": 900,
            "startupSeconds": 2400,
            "quantization": "fp8",
            "kvCacheDtype": "fp8",
            # a ReadWriteMany claim: pods of a scale-up load what the first one compiled
            "cache": {"persistentVolumeClaim": {"claimName": "llama-8b-cache"}},
            "scaling": {
                "minReplicas": 2,
                "maxReplicas": 8,
                "targetTimeToFirstTokenSeconds": 0.8,
                "costCeilingPerMillionTokensUsd": 0.4,
                "scaleDownStabilizationSeconds": 900,
            },
        },
    },
    "cpu": {
        "exampleModelServer": {
            "gpusPerPod": 0,
            "pricePerGpuHour": 0,
            "drainSeconds": 0,
            "resources": {"requests": {"cpu": "4", "memory": "6Gi"}, "limits": {"cpu": "4", "memory": "6Gi"}},
            "cache": {"emptyDir": {"sizeLimit": "10Gi"}},
        }
    },
    "monitoring": {
        "operator": {
            "replicas": 2,
            "watchNamespaces": ["ml", NAMESPACE, "staging"],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"},
            ],
            "affinity": H200_AFFINITY,
            "extraEnv": [{"name": "TANDEM_OPERATOR_SCRAPE_INTERVAL_S", "value": "10"}],
        },
        "otel": {"enabled": True, "resourceAttributes": {"deployment.environment": "prod"}},
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "podMonitor": {"enabled": True},
            "dashboard": {"enabled": True, "namespace": "grafana"},
        },
        "networkPolicy": {"enabled": True, "grpcFrom": [CLIENTS], "metricsFrom": [PROMETHEUS]},
    },
    "tls": {
        "exampleModelServer": {
            "tls": {"secretName": "smollm2-tls", "clientCASecretName": "smollm2-client-ca"},
            "auth": {"tokenSecretName": "smollm2-tokens", "tokenKey": "api-tokens"},
            "reflection": False,
        },
        "networkPolicy": {"enabled": True, "grpcFrom": [CLIENTS]},
    },
    "operator-metrics": {
        "operator": {"metrics": {"enabled": True, "port": 9090}},
        "monitoring": {"operatorPodMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "networkPolicy": {"enabled": True, "metricsFrom": [PROMETHEUS]},
        "exampleModelServer": {"scaling": {"mode": "External", "minReplicas": 1, "maxReplicas": 6}},
    },
    "gateway": {
        "inferenceGateway": {
            "enabled": True,
            "failureMode": "FailClose",
            "endpointPicker": {
                "replicas": 2,
                "nodeSelector": {"kubernetes.io/os": "linux"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system"}],
            },
        },
        "networkPolicy": {"enabled": True, "metricsFrom": [PROMETHEUS]},
    },
    "no-example": {
        "exampleModelServer": {"enabled": False},
        "tests": {"target": "llama-8b.ml.svc:50051"},
        "serviceAccount": {"create": False, "name": "platform-operator"},
    },
}


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART


@pytest.fixture(scope="session")
def chart(chart_dir: Path) -> Iterator[helm.Chart]:
    with helm.Chart.load(chart_dir) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict) -> list[dict]:
    """Every object the chart renders for `values` (NOTES.txt aside)."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [
        doc
        for path, text in sorted(out.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@pytest.fixture(scope="session")
def rendered(chart: helm.Chart) -> dict[str, list[dict]]:
    return {name: render(chart, values) for name, values in VALUE_SETS.items()}


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    (found,) = objects(docs, kind)
    return found


def crd_docs(chart: helm.Chart) -> dict[str, dict]:
    return {
        doc["spec"]["names"]["kind"]: doc
        for crd in chart.crds
        for doc in yaml.safe_load_all(crd["data"])
        if doc
    }


def crd_json_schema(crd: dict) -> dict:
    """The CRD's openAPIV3Schema as a JSON schema that, like `kubectl apply` (field validation
    Strict), rejects fields the CRD does not declare."""

    def convert(node: object) -> object:
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if out.get("exclusiveMinimum") is True:  # OpenAPI 3.0's boolean form
            out["exclusiveMinimum"] = out.pop("minimum")
        if out.pop("nullable", False):
            out["type"] = [out["type"], "null"]
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out

    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    schema = convert(version["schema"]["openAPIV3Schema"])
    assert isinstance(schema, dict)
    # every object has these, whether the CRD spells them out or not
    for field, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
        schema.setdefault("properties", {}).setdefault(field, {"type": kind})
    return schema


def modelserver_spec_schema(chart: helm.Chart) -> dict:
    (version,) = crd_docs(chart)["ModelServer"]["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def validate_custom(doc: dict, crds: dict[str, dict]) -> None:
    crd = crds[doc["kind"]]
    group, version = doc["apiVersion"].split("/")
    assert group == crd["spec"]["group"]
    assert version in [v["name"] for v in crd["spec"]["versions"] if v["served"]]
    jsonschema.Draft7Validator(crd_json_schema(crd)).validate(doc)


def labels_of(doc: dict) -> dict:
    return doc["metadata"].get("labels", {})


def pod_specs(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    for doc in docs:
        if doc["kind"] == "Deployment":
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]
        elif doc["kind"] == "Pod":
            yield doc["metadata"]["name"], doc["spec"]


def run_tandem(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-m", "tandem.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd="/", timeout=60)


@pytest.fixture()
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


# ---------------------------------------------------------------- lint and API validation


@pytest.mark.parametrize("value_set", VALUE_SETS)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_lint_strict_has_no_findings(chart_dir: Path, value_set: str, kube_version: str) -> None:
    report = helm.lint(chart_dir, VALUE_SETS[value_set], strict=True, kube_version=f"v{kube_version}")
    assert report["errors"] == []
    # severity 1 is "info" (Chart.yaml has no icon); warnings (2) and errors (3) fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_manifest_passes_the_api_schemas(
    chart: helm.Chart, rendered: dict[str, list[dict]], value_set: str
) -> None:
    crds = crd_docs(chart)
    for doc in rendered[value_set]:
        if doc["kind"] in crds:
            validate_custom(doc, crds)
            continue
        if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
            continue  # Prometheus Operator CRDs: no offline schema; checked field by field below
        if doc["kind"] == "InferencePool":
            continue  # the Inference Extension's: test_chart_gateway.py checks it against its API
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_crds_pass_the_api_schemas(chart: helm.Chart) -> None:
    crds = crd_docs(chart)
    assert set(crds) == {"ModelServer"}  # no kopf peering CRDs: a Lease elects the leader
    for crd in crds.values():
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(crd, version, strict=True)
    model_server = crds["ModelServer"]
    assert model_server["metadata"]["name"] == "modelservers.tandem.dev"
    assert [v["name"] for v in model_server["spec"]["versions"]] == ["v1alpha1"]


def test_crd_schema_check_catches_unknown_and_wrong_fields(chart: helm.Chart, rendered) -> None:
    """The CRD check above is not a rubber stamp: a typo or a wrong type in a ModelServer fails it."""
    crds = crd_docs(chart)
    example = one(rendered["default"], "ModelServer")
    broken_specs = (
        {"gpuPerPod": 1},
        {"gpusPerPod": "one"},
        {"scaling": {"maxReplica": 3}},
        {"tls": {}},  # TLS without a certificate
        {"tls": {"clientCASecretName": "ca"}},
        {"tls": {"secretName": "tls", "clientCaSecretName": "ca"}},  # the CRD spells it clientCASecretName
        {"tls": {"secretName": "Server_TLS"}},  # not a Secret name
        {"auth": {"tokenKey": "tokens"}},
        {"auth": {"tokenSecretName": "tokens", "tokenKey": "../tokens"}},
        {"reflection": "off"},
        {"quantization": "int4"},
        {"quantization": "FP8"},
        {"kvCacheDtype": "fp16"},
        {"cache": {}},  # a cache without a source
        {"cache": {"emptyDir": {}, "hostPath": {"path": "/var/lib/tandem"}}},  # two sources
        {"cache": {"emptyDir": {"sizeLimit": "50GB"}}},
        {"cache": {"emptyDir": {"medium": "HugePages"}}},
        {"cache": {"hostPath": {}}},
        {"cache": {"hostPath": {"path": "var/lib/tandem"}}},
        {"cache": {"persistentVolumeClaim": {"claimName": "Model_Cache"}}},
        {"cache": {"pvc": {"claimName": "cache"}}},
    )
    for broken_spec in broken_specs:
        broken = copy.deepcopy(example)
        broken["spec"].update(broken_spec)
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(broken, crds)


def test_every_kind_is_expected(rendered: dict[str, list[dict]]) -> None:
    kinds = {name: sorted({d["kind"] for d in docs}) for name, docs in rendered.items()}
    base = ["ClusterRole", "ClusterRoleBinding", "Deployment", "Pod", "Role", "RoleBinding"]
    assert kinds["default"] == sorted([*base, "ModelServer", "ServiceAccount"])
    assert kinds["monitoring"] == sorted(
        [*base, "ConfigMap", "ModelServer", "NetworkPolicy", "PodMonitor", "ServiceAccount", "ServiceMonitor"]
    )
    assert kinds["no-example"] == sorted(base)
    assert kinds["gateway"] == sorted(
        [*base, "ConfigMap", "InferencePool", "ModelServer", "NetworkPolicy", "Service", "ServiceAccount"]
    )


# ---------------------------------------------------------------- values schema


BAD_VALUES = [
    {"replicaCount": 2},  # unknown top-level key
    {"operator": {"replicas": "two"}},
    {"operator": {"replica": 2}},  # unknown nested key
    {"operator": {"image": {"pullPolicy": "Sometimes"}}},
    {"operator": {"watchNamespaces": ["team-*"]}},  # exact names only: the RBAC is per namespace
    {"operator": {"tolerations": {"key": "gpu"}}},
    {"server": {"image": {"digest": "latest"}}},
    {"exampleModelServer": {"gpusPerPod": -1}},
    {"exampleModelServer": {"gpusPerPod": 2}},  # the engine uses one GPU
    {"exampleModelServer": {"gpusPerPod": "1"}},
    {"exampleModelServer": {"pricePerGpuHour": -0.5}},
    {"exampleModelServer": {"scaling": {"minReplicas": 0}}},
    {"exampleModelServer": {"scaling": {"maxReplica": 4}}},
    {"exampleModelServer": {"name": "Llama_8B"}},
    {"exampleModelServer": {"env": [{"value": "no name"}]}},
    {"exampleModelServer": {"tls": {"secretName": "Server_TLS"}}},
    {"exampleModelServer": {"tls": {"secret": "server-tls"}}},
    {"exampleModelServer": {"auth": {"tokenSecretName": "tokens", "tokenKey": ""}}},
    {"exampleModelServer": {"reflection": "false"}},
    {"exampleModelServer": {"quantization": "int8"}},
    {"exampleModelServer": {"kvCacheDtype": "fp16"}},
    {"exampleModelServer": {"cache": {"emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}}},
    {"exampleModelServer": {"cache": {"emptyDir": {"sizeLimit": "50GB"}}}},
    {"exampleModelServer": {"cache": {"hostPath": {"path": "var/lib/tandem"}}}},
    {"exampleModelServer": {"cache": {"persistentVolumeClaim": {}}}},
    {"exampleModelServer": {"cache": {"nfs": {"server": "nfs.example.com"}}}},
    {"monitoring": {"serviceMonitor": {"interval": 15}}},
    {"operator": {"metrics": {"port": 8080}}},  # the liveness port
    {"operator": {"metrics": {"port": 0}}},  # off is enabled: false
    {"operator": {"metrics": {"enable": True}}},
    {"exampleModelServer": {"scaling": {"mode": "HPA"}}},
    {"otel": {"protocol": "http/protobuf"}},  # the servers speak OTLP/gRPC only
    {"tests": {"timeoutSeconds": 0}},
    {"networkPolicy": {"enabled": "yes"}},
    {"inferenceGateway": {"enabled": "true"}},
    {"inferenceGateway": {"failureMode": "Open"}},
    {"inferenceGateway": {"modelServers": ["smollm2"]}},  # {name, namespace} objects
    {"inferenceGateway": {"modelServers": [{"name": "Llama_8B"}]}},
    {"inferenceGateway": {"modelServers": [{"name": "m" * 60}]}},  # NAME-epp: over 63 characters
    {"inferenceGateway": {"modelServers": [{"namespace": "ml"}]}},
    {"inferenceGateway": {"endpointPicker": {"replicas": 0}}},
    {"inferenceGateway": {"endpointPicker": {"metricsPort": 9400}}},
    {"inferenceGateway": {"endpointPicker": {"image": {"tag": ""}}}},  # not the chart's appVersion
]


@pytest.mark.parametrize("values", BAD_VALUES, ids=lambda v: json.dumps(v, separators=(",", ":")))
def test_schema_rejects_wrong_values(chart: helm.Chart, values: dict) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_schema_is_closed_and_described(chart: helm.Chart) -> None:
    schema = chart.schema
    assert schema is not None and schema["additionalProperties"] is False
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(schema["properties"]) == set(defaults), "values.yaml and the schema list the same keys"

    def walk(node: dict, where: str) -> None:
        if "$ref" not in node:
            assert node.get("description"), f"{where} has no description"
        for name, child in node.get("properties", {}).items():
            walk(child, f"{where}.{name}")

    for name, prop in schema["properties"].items():
        walk(prop, name)


def test_example_values_name_real_crd_fields(chart: helm.Chart) -> None:
    """exampleModelServer mirrors ModelServer.spec: no value that the CRD would not know."""
    spec = modelserver_spec_schema(chart)
    example = chart.schema["properties"]["exampleModelServer"]["properties"]
    chart_only = {"enabled", "name"}
    scheduling = {"nodeSelector", "tolerations", "affinity"}  # rendered only when the CRD has them
    assert set(example) - chart_only - scheduling <= set(spec["properties"]) - {"image", "imagePullPolicy"}
    assert set(example["model"]["properties"]) <= set(spec["properties"]["model"]["properties"])
    assert set(example["scaling"]["properties"]) <= set(spec["properties"]["scaling"]["properties"])
    for key in ("tls", "auth"):
        assert set(example[key]["properties"]) == set(spec["properties"][key]["properties"]), key
    cache, spec_cache = example["cache"]["properties"], spec["properties"]["cache"]["properties"]
    assert set(cache) == set(spec_cache)
    for source in cache:
        assert set(cache[source]["properties"]) == set(spec_cache[source]["properties"]), source
        assert cache[source].get("required") == spec_cache[source].get("required"), source


# ---------------------------------------------------------------- security


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_are_locked_down(rendered: dict[str, list[dict]], value_set: str) -> None:
    specs = dict(pod_specs(rendered[value_set]))
    assert specs, "the chart renders pods"
    for name, spec in specs.items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["privileged"] is False, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], name
        # a token only where the API is called: the operator, and the inference gateway's endpoint
        # pickers (they watch their pool and its pods)
        assert spec["automountServiceAccountToken"] is name.endswith(("-operator", "-epp")), name


def test_service_account_does_not_hand_out_tokens(rendered: dict[str, list[dict]]) -> None:
    sa = one(rendered["default"], "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    deployment = one(rendered["default"], "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    no_sa = rendered["no-example"]
    assert objects(no_sa, "ServiceAccount") == []
    assert one(no_sa, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"


# ---------------------------------------------------------------- RBAC

# docs/operator.md, "Permissions": exactly these, nothing more.
NAMESPACED_RULES = {
    ("tandem.dev", "modelservers"): {"list", "watch", "patch"},
    ("tandem.dev", "modelservers/status"): {"patch"},
    ("apps", "deployments"): {"get", "create", "patch"},
    ("apps", "deployments/scale"): {"patch"},
    ("", "services"): {"get", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch"},
    ("", "pods"): {"list"},
    ("", "events"): {"create"},
}
CRD_RULES = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
# leader election: create any Lease (create cannot be limited by name), read and update the one
LEASE_RULES = {
    ("coordination.k8s.io", "leases"): {"create"},
    ("coordination.k8s.io", "leases/tandem-operator"): {"get", "update"},
}


def rule_table(role: dict) -> dict[tuple[str, str], set[str]]:
    """(group, resource) -> verbs; a rule naming objects counts as (group, resource/name)."""
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert "*" not in (group, resource) and "*" not in rule["verbs"]
                for name in rule.get("resourceNames") or [None]:
                    key = (group, f"{resource}/{name}" if name else resource)
                    table.setdefault(key, set()).update(rule["verbs"])
    return table


def operator_cluster_role(docs: list[dict]) -> dict:
    """The operator's own ClusterRole (beside the user roles: those that aggregate into the built-in
    ones, and the scaler role, all named ...-modelservers-...)."""
    (role,) = [r for r in objects(docs, "ClusterRole") if "-modelservers-" not in r["metadata"]["name"]]
    return role


def lease_role(docs: list[dict]) -> dict:
    (role,) = [r for r in objects(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    return role


def test_cluster_wide_rbac_is_exactly_what_the_operator_calls(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["default"]
    role = operator_cluster_role(docs)
    assert rule_table(role) == {**CRD_RULES, **NAMESPACED_RULES}
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = one(docs, "ServiceAccount")
    subject = {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    assert binding["subjects"] == [subject]
    # the Lease's rules only in the release namespace, apart from everything else
    assert [r["metadata"]["name"] for r in objects(docs, "Role")] == [lease_role(docs)["metadata"]["name"]]
    assert lease_role(docs)["metadata"]["namespace"] == NAMESPACE
    assert rule_table(lease_role(docs)) == LEASE_RULES


def test_namespaced_rbac_grants_only_the_watched_namespaces(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["monitoring"]
    assert rule_table(operator_cluster_role(docs)) == CRD_RULES
    leases = lease_role(docs)
    assert rule_table(leases) == LEASE_RULES and leases["metadata"]["namespace"] == NAMESPACE
    roles = {r["metadata"]["namespace"]: r for r in objects(docs, "Role") if r is not leases}
    assert set(roles) == {"ml", NAMESPACE, "staging"}
    for role in roles.values():
        assert rule_table(role) == NAMESPACED_RULES
    bindings = {
        b["metadata"]["namespace"]: b
        for b in objects(docs, "RoleBinding")
        if not b["metadata"]["name"].endswith("-leader-election")
    }
    assert set(bindings) == {"ml", NAMESPACE, "staging"}
    for namespace, binding in bindings.items():
        assert binding["roleRef"]["name"] == roles[namespace]["metadata"]["name"]
        assert binding["subjects"][0]["namespace"] == NAMESPACE


USER_EDIT_RULES = {
    ("tandem.dev", "modelservers"): {
        "get", "list", "watch", "create", "update", "patch", "delete", "deletecollection",
    },
    ("tandem.dev", "modelservers/scale"): {"get", "update", "patch"},
    ("tandem.dev", "modelservers/status"): {"get"},
}  # fmt: skip
USER_VIEW_RULES = {
    ("tandem.dev", r): {"get", "list", "watch"}
    for r in ("modelservers", "modelservers/scale", "modelservers/status")
}
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def test_user_roles_aggregate_modelservers_into_the_built_in_roles(chart: helm.Chart) -> None:
    """Kubernetes' admin, edit and view ClusterRoles do not know a CRD: the chart's aggregated roles
    let a namespace's editors manage and `kubectl scale` ModelServers and its viewers read them,
    with nothing outside tandem.dev; rbac.aggregateToDefaultRoles=false ships neither."""
    docs = render(chart, {})
    roles = {
        label.removeprefix(AGGREGATE): r
        for r in objects(docs, "ClusterRole")
        for label, value in r["metadata"]["labels"].items()
        if label.startswith(AGGREGATE) and value == "true"
    }
    assert set(roles) == {"admin", "edit", "view"} and roles["admin"] is roles["edit"]
    assert rule_table(roles["edit"]) == USER_EDIT_RULES and rule_table(roles["view"]) == USER_VIEW_RULES
    bound = {b["roleRef"]["name"] for b in objects(docs, "ClusterRoleBinding")}
    assert not bound & {r["metadata"]["name"] for r in roles.values()}  # granted by aggregation only
    off = render(chart, {"rbac": {"aggregateToDefaultRoles": False}})
    names = {r["metadata"]["name"] for r in objects(off, "ClusterRole")}
    assert names == {operator_cluster_role(off)["metadata"]["name"], scaler_role(off)["metadata"]["name"]}


def scaler_role(docs: list[dict]) -> dict:
    (role,) = [r for r in objects(docs, "ClusterRole") if r["metadata"]["name"].endswith("-scaler")]
    return role


def test_a_scaler_role_lets_its_holder_scale_modelservers_and_nothing_else(chart: helm.Chart) -> None:
    """For a person or an external scaler that sets the pods of a ModelServer in mode External: read
    ModelServers, read and write their scale subresource, nothing more; the user binds it (the chart
    binds it to no one and aggregates it into no built-in role); rbac.create=false ships none."""
    docs = render(chart, {})
    role = scaler_role(docs)
    assert rule_table(role) == {
        ("tandem.dev", "modelservers"): {"get", "list", "watch"},
        ("tandem.dev", "modelservers/scale"): {"get", "update", "patch"},
    }
    assert not any(label.startswith(AGGREGATE) for label in role["metadata"]["labels"])
    bound = {b["roleRef"]["name"] for b in objects(docs, "ClusterRoleBinding") + objects(docs, "RoleBinding")}
    assert role["metadata"]["name"] not in bound
    assert not [r for r in objects(render(chart, {"rbac": {"create": False}}), "ClusterRole")
                if r["metadata"]["name"].endswith("-modelservers-scaler")]


def test_operator_elects_a_leader_on_the_lease_the_rbac_names(rendered: dict[str, list[dict]]) -> None:
    for name, docs in rendered.items():
        container = operator_container(docs)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TANDEM_OPERATOR_LEADER_ELECTION"] == "true", name
        assert env["TANDEM_OPERATOR_LEADER_ELECTION_NAMESPACE"] == NAMESPACE
        assert env["TANDEM_OPERATOR_LEADER_ELECTION_IDENTITY"] == "$(POD_NAME)"  # set above it
        names = [e["name"] for e in container["env"]]
        assert names.index("POD_NAME") < names.index("TANDEM_OPERATOR_LEADER_ELECTION_IDENTITY")
        (named,) = [r for r in lease_role(docs)["rules"] if r.get("resourceNames")]
        assert named["resourceNames"] == [env["TANDEM_OPERATOR_LEADER_ELECTION_LEASE"]] == ["tandem-operator"]
        assert "TANDEM_OPERATOR_PEERING" not in env


# ---------------------------------------------------------------- the operator Deployment


def test_operator_deployment(rendered: dict[str, list[dict]]) -> None:
    deployment = one(rendered["monitoring"], "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    template = deployment["spec"]["template"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["replicas"] == 2
    # a real lock (the Lease): a rolling update may run the new pod beside the old one
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    spec = template["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "tandem-operator:0.1.0"
    assert "command" not in container and container["args"] == ["operator"], "no peering priorities to draw"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TANDEM_OPERATOR_SCRAPE_INTERVAL_S"] == "10"
    assert env["TANDEM_OPERATOR_LOG_LEVEL"] == "INFO"
    assert env["OTEL_SERVICE_NAME"] == "tandem-operator"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "deployment.environment=prod"
    # liveness: kopf's endpoint, on the port the operator is told to use
    probe = container["livenessProbe"]["httpGet"]
    (port,) = [p for p in container["ports"] if p["name"] == probe["port"]]
    assert probe["path"] == "/healthz"
    assert str(port["containerPort"]) == env["TANDEM_OPERATOR_LIVENESS_PORT"] == "8080"
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["tolerations"][0]["key"] == "dedicated"
    assert spec["affinity"] == H200_AFFINITY
    # the read-only root filesystem leaves /tmp writable through an emptyDir
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_single_operator_runs_tandem_operator_directly(rendered: dict[str, list[dict]]) -> None:
    (container,) = one(rendered["default"], "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "the image's entrypoint is `tandem`"
    assert container["args"] == ["operator"]


def test_chart_app_version_is_the_package_version(chart: helm.Chart) -> None:
    """Image tags default to appVersion: it must name the release the images are built from."""
    import tomllib

    import tandem

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert chart.metadata["appVersion"] == pyproject["project"]["version"] == tandem.__version__


def test_every_object_carries_the_common_labels(rendered: dict[str, list[dict]]) -> None:
    for docs in rendered.values():
        for doc in docs:
            labels = labels_of(doc)
            assert labels["app.kubernetes.io/part-of"] == "tandem", doc["kind"]
            assert labels["app.kubernetes.io/managed-by"] == "Helm", doc["kind"]
            assert labels["helm.sh/chart"] == "tandem-0.1.0", doc["kind"]
            assert labels["app.kubernetes.io/instance"] == RELEASE, doc["kind"]


# ---------------------------------------------------------------- the example ModelServer


def test_gpu_example_takes_its_resources_from_the_values(rendered: dict[str, list[dict]]) -> None:
    spec = one(rendered["gpu"], "ModelServer")["spec"]
    assert spec["gpuResourceName"] == "nvidia.com/mig-3g.71gb"
    assert spec["gpusPerPod"] == 1
    assert spec["pricePerGpuHour"] == 3.5
    assert spec["image"] == "registry.example.com/ml/tandem-server:0.1.0@sha256:" + "ab" * 32
    assert spec["imagePullPolicy"] == "Always"
    assert spec["model"] == {
        "source": "/models/Llama-3.1-8B-Instruct",
        "name": "llama-3.1-8b-instruct",
        "persistentVolumeClaim": "models",
        "mountPath": "/models",
    }
    assert (spec["maxNumSeqs"], spec["drainSeconds"], spec["startupSeconds"]) == (128, 900, 2400)
    assert spec["env"] == [{"name": "TANDEM_MAX_MODEL_LEN", "value": "8192"}]
    assert spec["scaling"]["minReplicas"] == 2 and spec["scaling"]["costCeilingPerMillionTokensUsd"] == 0.4


def test_cpu_example_asks_for_no_gpu(rendered: dict[str, list[dict]]) -> None:
    spec = one(rendered["cpu"], "ModelServer")["spec"]
    assert spec["gpusPerPod"] == 0 and spec["pricePerGpuHour"] == 0
    assert spec["drainSeconds"] == 0, "a zero is a value, not 'unset'"
    assert "maxNumSeqs" not in spec and "startupSeconds" not in spec, "null: the CRD's default"
    assert spec["resources"]["limits"] == {"cpu": "4", "memory": "6Gi"}
    assert "model" not in spec, "no source: the model embedded in the image"
    default = one(rendered["default"], "ModelServer")["spec"]
    assert default["gpusPerPod"] == 1 and default["gpuResourceName"] == "nvidia.com/gpu"
    assert default["image"] == "tandem-server:0.1.0"


def test_example_servers_export_traces_when_otel_is_on(rendered: dict[str, list[dict]]) -> None:
    env = {e["name"]: e["value"] for e in one(rendered["monitoring"], "ModelServer")["spec"]["env"]}
    assert env["OTEL_SERVICE_NAME"] == "tandem-server"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert "env" not in one(rendered["default"], "ModelServer")["spec"]


def test_tls_auth_and_reflection_reach_the_example(
    rendered: dict[str, list[dict]], chart: helm.Chart
) -> None:
    spec = one(rendered["tls"], "ModelServer")["spec"]
    assert spec["tls"] == {"secretName": "smollm2-tls", "clientCASecretName": "smollm2-client-ca"}
    assert spec["auth"] == {"tokenSecretName": "smollm2-tokens", "tokenKey": "api-tokens"}
    assert spec["reflection"] is False
    default = one(rendered["default"], "ModelServer")["spec"]
    assert "tls" not in default and "auth" not in default, "empty Secret names: plaintext, no token"
    assert default["reflection"] is True
    assert default["openaiApi"] is True
    off = render(chart, {"exampleModelServer": {"openaiApi": False}})
    assert one(off, "ModelServer")["spec"]["openaiApi"] is False


def test_fp8_values_reach_the_model_server_pods(rendered: dict[str, list[dict]]) -> None:
    """exampleModelServer.quantization and .kvCacheDtype become the ModelServer's spec fields, which
    the operator turns into the server's TANDEM_QUANTIZATION and TANDEM_KV_CACHE_DTYPE."""
    from tandem.operator import resources
    from tandem.operator.spec import parse_spec

    def server_env(value_set: str) -> dict[str, str]:
        spec = one(rendered[value_set], "ModelServer")["spec"]
        pod = resources.deployment("m", parse_spec(spec), 9400)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        return {e["name"]: e["value"] for e in container["env"]}

    gpu = one(rendered["gpu"], "ModelServer")["spec"]
    assert (gpu["quantization"], gpu["kvCacheDtype"]) == ("fp8", "fp8")
    assert server_env("gpu").items() >= {"TANDEM_QUANTIZATION": "fp8", "TANDEM_KV_CACHE_DTYPE": "fp8"}.items()
    default = one(rendered["default"], "ModelServer")["spec"]
    assert "quantization" not in default and default["kvCacheDtype"] == "auto"  # as the checkpoint is
    assert not {"TANDEM_QUANTIZATION", "TANDEM_KV_CACHE_DTYPE"} & set(server_env("default"))


def test_client_ca_without_a_certificate_is_refused(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="clientCASecretName needs tls.secretName"):
        render(chart, {"exampleModelServer": {"tls": {"clientCASecretName": "clients-ca"}}})


def test_gpu_node_scheduling_reaches_the_crd_or_is_refused(chart: helm.Chart) -> None:
    """nodeSelector/tolerations/affinity go into spec only if the CRD has the field; otherwise
    rendering fails with a clear message instead of the API server pruning them silently."""
    crd_fields = set(modelserver_spec_schema(chart)["properties"])
    scheduling = {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": H200_AFFINITY,
    }
    for key, value in scheduling.items():
        values = {"exampleModelServer": {key: value}}
        if key in crd_fields:
            assert one(render(chart, values), "ModelServer")["spec"][key] == value
        else:
            with pytest.raises(helm.HelmRenderError, match=f"has no spec.{key}"):
                render(chart, values)


# ---------------------------------------------------------------- monitoring, dashboard, network


def test_monitors_select_the_operators_model_pods(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["monitoring"]
    # docs/operator.md: the labels the operator puts on model pods and Services
    operator_labels = {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/component": "model-server",
        "app.kubernetes.io/managed-by": "tandem-operator",
    }
    service_monitor, pod_monitor = one(docs, "ServiceMonitor"), one(docs, "PodMonitor")
    assert labels_of(service_monitor)["release"] == "prometheus"
    for monitor, endpoints in ((service_monitor, "endpoints"), (pod_monitor, "podMetricsEndpoints")):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= operator_labels.items()
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml", NAMESPACE, "staging"]}
        (endpoint,) = monitor["spec"][endpoints]
        assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")
    for docs_without in (rendered["default"], rendered["gpu"]):
        assert not objects(docs_without, "ServiceMonitor") and not objects(docs_without, "PodMonitor")


def test_dashboard_configmap_ships_the_dashboard_file(chart_dir: Path, rendered: dict) -> None:
    configmap = one(rendered["monitoring"], "ConfigMap")
    assert configmap["metadata"]["namespace"] == "grafana"
    assert labels_of(configmap)["grafana_dashboard"] == "1"
    shipped = (chart_dir / "dashboards" / "tandem.json").read_text()
    assert configmap["data"]["tandem.json"] == shipped.rstrip("\n")
    assert json.loads(configmap["data"]["tandem.json"])["title"]
    assert objects(rendered["default"], "ConfigMap") == []


def test_network_policies(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["monitoring"]
    policies = objects(docs, "NetworkPolicy")
    operator_policy = [p for p in policies if p["metadata"]["name"].endswith("-operator")]
    server_policies = {p["metadata"]["namespace"]: p for p in policies if p not in operator_policy}
    assert set(server_policies) == {NAMESPACE, "ml", "staging"}
    operator_pod = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    test_pod = labels_of(one(docs, "Pod"))
    for policy in server_policies.values():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        grpc_rule, metrics_rule = spec["ingress"]
        # the plaintext health port (used under TLS) is open to whoever may call gRPC
        assert grpc_rule["ports"] == [
            {"port": 50051, "protocol": "TCP"},
            {"port": 50052, "protocol": "TCP"},
            {"port": 8000, "protocol": "TCP"},  # the OpenAI HTTP API: the same callers as gRPC
        ]
        assert CLIENTS in grpc_rule["from"]
        assert any(p["podSelector"]["matchLabels"].items() <= test_pod.items() for p in grpc_rule["from"][1:])
        assert metrics_rule["ports"] == [{"port": 9400, "protocol": "TCP"}]
        assert PROMETHEUS in metrics_rule["from"]
        from_operator = metrics_rule["from"][0]
        assert from_operator["podSelector"]["matchLabels"].items() <= operator_pod.items()
        assert from_operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    (policy,) = operator_policy
    # the liveness probe from anywhere (the kubelet); the operator's own /metrics from metricsFrom
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": "health", "protocol": "TCP"}]},
        {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": [PROMETHEUS]},
    ]
    assert objects(rendered["default"], "NetworkPolicy") == []
    # without metricsFrom nobody may scrape the operator: no rule (a rule without `from` admits all)
    (tls_policy,) = [
        p for p in objects(rendered["tls"], "NetworkPolicy") if p["metadata"]["name"].endswith("-operator")
    ]
    assert tls_policy["spec"]["ingress"] == [{"ports": [{"port": "health", "protocol": "TCP"}]}]


def operator_container(docs: list[dict]) -> dict:
    """The operator's container (beside it, the value set `gateway` renders endpoint pickers)."""
    (deployment,) = [d for d in objects(docs, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_operator_serves_its_own_metrics_on_the_port_it_is_told(rendered: dict[str, list[dict]]) -> None:
    """The container port `metrics` and TANDEM_OPERATOR_PROMETHEUS_PORT agree, beside the liveness
    port; off, neither is there (port 0)."""
    for value_set, port in (("default", 8081), ("operator-metrics", 9090)):
        container = operator_container(rendered[value_set])
        env = {e["name"]: e.get("value") for e in container["env"]}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"health": 8080, "metrics": port}, value_set
        assert env["TANDEM_OPERATOR_PROMETHEUS_PORT"] == str(port) != env["TANDEM_OPERATOR_LIVENESS_PORT"]


def test_operator_metrics_off(chart: helm.Chart) -> None:
    container = operator_container(render(chart, {"operator": {"metrics": {"enabled": False}}}))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TANDEM_OPERATOR_PROMETHEUS_PORT"] == "0"
    assert [p["name"] for p in container["ports"]] == ["health"]
    on = {
        "monitoring": {"operatorPodMonitor": {"enabled": True}},
        "operator": {"metrics": {"enabled": False}},
    }
    with pytest.raises(helm.HelmRenderError, match="needs operator.metrics.enabled"):
        render(chart, on)


def test_operator_pod_monitor_scrapes_every_operator_pod(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["operator-metrics"]
    (monitor,) = [m for m in objects(docs, "PodMonitor") if m["metadata"]["name"].endswith("-operator")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert labels_of(monitor)["release"] == "prometheus"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    template = one(docs, "Deployment")["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (port,) = [p for p in operator_container(docs)["ports"] if p["name"] == endpoint["port"]]
    assert (port["containerPort"], endpoint["path"], endpoint["interval"]) == (9090, "/metrics", "30s")
    # the operator's namespace label names the ModelServer's namespace, not the operator pod's
    assert endpoint["honorLabels"] is True
    assert all(
        not m["metadata"]["name"].endswith("-operator") for m in objects(rendered["monitoring"], "PodMonitor")
    )


def test_example_can_leave_scaling_to_an_external_scaler(rendered: dict[str, list[dict]]) -> None:
    spec = one(rendered["operator-metrics"], "ModelServer")["spec"]
    assert spec["scaling"]["mode"] == "External"
    assert "replicas" not in spec, "helm must not own spec.replicas: the HPA, KEDA or the operator does"
    assert "mode" not in one(rendered["default"], "ModelServer")["spec"]["scaling"], (
        "unset: the CRD's Operator"
    )


# ---------------------------------------------------------------- helm test, NOTES


def test_helm_test_pod_checks_the_example_service(rendered: dict[str, list[dict]]) -> None:
    pod = one(rendered["gpu"], "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "tandem-operator:0.1.0", "the slim image has `tandem health`"
    assert container["args"][:3] == ["health", "--target", f"llama-8b.{NAMESPACE}.svc:50051"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    other = one(rendered["no-example"], "Pod")["spec"]["containers"][0]["args"]
    assert other[:3] == ["health", "--target", "llama-8b.ml.svc:50051"]


def test_helm_test_pod_asks_the_plaintext_health_port_under_tls(chart: helm.Chart, rendered) -> None:
    """The check speaks neither TLS nor tokens: under TLS it asks port 50052; with a token alone the
    main port still answers health without one."""
    args = one(rendered["tls"], "Pod")["spec"]["containers"][0]["args"]
    assert args[:3] == ["health", "--target", f"smollm2.{NAMESPACE}.svc:50052"]
    token_only = render(chart, {"exampleModelServer": {"auth": {"tokenSecretName": "smollm2-tokens"}}})
    assert one(token_only, "Pod")["spec"]["containers"][0]["args"][2] == f"smollm2.{NAMESPACE}.svc:50051"


def test_helm_test_pod_command_passes_on_serving_and_fails_otherwise(
    chart: helm.Chart, health_server: tuple[str, health.HealthServicer]
) -> None:
    """The pod's own arguments, run by the real CLI against a live grpc.health.v1 service."""
    address, servicer = health_server
    pod = one(render(chart, {"tests": {"target": address, "timeoutSeconds": 5}}), "Pod")
    args = pod["spec"]["containers"][0]["args"]
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    passed = run_tandem(args)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    failed = run_tandem(args)
    assert failed.returncode == 1 and "NOT_SERVING" in failed.stdout


def test_example_must_be_in_a_watched_namespace(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="not in operator.watchNamespaces"):
        render(chart, {"operator": {"watchNamespaces": ["ml"]}})
    assert objects(render(chart, {"operator": {"watchNamespaces": ["ml", NAMESPACE]}}), "ModelServer")


def test_helm_test_without_example_needs_a_target(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="tests.target"):
        render(chart, {"exampleModelServer": {"enabled": False}})
    without_test = {"exampleModelServer": {"enabled": False}, "tests": {"enabled": False}}
    assert objects(render(chart, without_test), "Pod") == []


def test_notes_tell_how_to_call_the_server(chart: helm.Chart) -> None:
    notes = chart.render(VALUE_SETS["gpu"], name=RELEASE, namespace=NAMESPACE)["tandem/templates/NOTES.txt"]
    assert f"kubectl port-forward -n {NAMESPACE} svc/llama-8b 50051:50051" in notes
    assert "tandem generate --server localhost:50051" in notes
    assert f"llama-8b.{NAMESPACE}.svc:50051" in notes
    assert f"kubectl port-forward -n {NAMESPACE} svc/llama-8b 8000:8000" in notes
    assert "curl http://localhost:8000/v1/chat/completions" in notes
    assert f"http://llama-8b.{NAMESPACE}.svc:8000/v1" in notes
    assert "1 x nvidia.com/mig-3g.71gb per pod" in notes
    assert f"helm test {RELEASE}" in notes


def test_notes_under_tls_and_tokens(chart: helm.Chart) -> None:
    notes = chart.render(VALUE_SETS["tls"], name=RELEASE, namespace=NAMESPACE)["tandem/templates/NOTES.txt"]
    assert "-plaintext" not in notes and "tandem generate" not in notes
    assert "-cacert ca.crt -cert client.crt -key client.key" in notes
    assert f"-servername smollm2.{NAMESPACE}.svc" in notes
    assert '-H "authorization: Bearer $TOKEN"' in notes
    assert "-proto tandem/v1/tandem.proto" in notes, "reflection is off"
    # HTTPS on the HTTP port too, checked for the Service's name, with the token
    svc = f"smollm2.{NAMESPACE}.svc"
    assert "--cert client.crt --key client.key" in notes
    assert f"--connect-to {svc}:8000:localhost:8000 https://{svc}:8000/v1/chat/completions" in notes
    assert '-H "Authorization: Bearer $TOKEN"' in notes
