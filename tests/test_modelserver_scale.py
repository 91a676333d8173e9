"""The ModelServer's scale subresource, as the chart installs it: an HPA, KEDA or `kubectl scale` can
use it (the paths name fields of the right types; the CRD passes the Kubernetes 1.29-1.33 API
schemas), ModelServers with a scaling mode pass the CRD and wrong ones do not, and the HPA and
KEDA examples of docs/operator.md target a ModelServer that leaves scaling to them."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_chart import CHART, KUBE_VERSIONS, crd_docs, validate_custom

from tandem.operator.spec import parse_spec

DOC = Path(__file__).resolve().parent.parent / "docs" / "operator.md"
TARGET = {"apiVersion": "tandem.dev/v1alpha1", "kind": "ModelServer"}


@pytest.fixture(scope="module")
def crds() -> Iterator[dict[str, dict]]:
    with helm.Chart.load(CHART) as chart:
        yield crd_docs(chart)


def schema_at(root: dict, json_path: str) -> dict:
    """The schema of the field a scale subresource path such as `.spec.replicas` names."""
    node = root
    for key in json_path.lstrip(".").split("."):
        node = node["properties"][key]
    return node


def test_the_scale_subresource_names_fields_an_hpa_can_use(crds: dict[str, dict]) -> None:
    crd = crds["ModelServer"]
    for version in KUBE_VERSIONS:  # the API server's own schema of a CRD, scale subresource included
        kubernetes_validate.validate(crd, version, strict=True)
    (served,) = crd["spec"]["versions"]
    scale = served["subresources"]["scale"]
    root = served["schema"]["openAPIV3Schema"]
    replicas = schema_at(root, scale["specReplicasPath"])
    assert scale["specReplicasPath"] == ".spec.replicas" and replicas["type"] == "integer"
    assert replicas["minimum"] == 0, "KEDA's scale to zero is accepted (and runs minReplicas)"
    # a default would be read as the replica count of every ModelServer without one, on the first
    # read after a CRD upgrade, and scale running servers to it
    assert "default" not in replicas
    assert scale["statusReplicasPath"] == ".status.replicas"
    assert schema_at(root, scale["statusReplicasPath"])["type"] == "integer"
    assert scale["labelSelectorPath"] == ".status.selector", "an HPA finds the pods through it"
    assert schema_at(root, scale["labelSelectorPath"])["type"] == "string", "a selector string"
    mode = schema_at(root, ".spec.scaling.mode")
    assert (mode["enum"], mode["default"]) == (["Operator", "External"], "Operator")
    columns = {c["name"]: c["jsonPath"] for c in served["additionalPrinterColumns"]}
    assert columns["Scaling"] == ".spec.scaling.mode"


def example(**spec: object) -> dict:
    return {
        **TARGET,
        "metadata": {"name": "llama", "namespace": "ml"},
        "spec": {"image": "tandem:1", **spec},
    }


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"replicas": 3},
        {"replicas": 0},
        {"scaling": {"mode": "External"}},
        {"replicas": 12, "scaling": {"mode": "External", "minReplicas": 2, "maxReplicas": 8}},
        {"scaling": {"mode": "Operator", "maxReplicas": 8}},
    ],
)
def test_modelservers_with_a_scaling_mode_pass_the_crd_and_the_operator(crds: dict, spec: dict) -> None:
    validate_custom(example(**spec), crds)
    parsed = parse_spec(example(**spec)["spec"])  # the operator agrees
    assert parsed.scaling.mode == spec.get("scaling", {}).get("mode", "Operator")


@pytest.mark.parametrize(
    "spec",
    [
        {"replicas": -1},
        {"replicas": "3"},
        {"replicas": 1.5},
        {"scaling": {"mode": "HPA"}},
        {"scaling": {"mode": "external"}},
        {"scaling": {"mode": None}},
    ],
)
def test_a_wrong_mode_or_replica_count_is_refused(crds: dict, spec: dict) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(example(**spec), crds)


def doc_objects() -> list[dict]:
    """Every object of the YAML blocks of docs/operator.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if isinstance(doc, dict)]


def test_the_documented_hpa_and_scaled_object_drive_an_external_modelserver(crds: dict) -> None:
    objects = doc_objects()
    servers = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "ModelServer"}
    (hpa,) = [o for o in objects if o.get("kind") == "HorizontalPodAutoscaler"]
    (keda,) = [o for o in objects if o.get("kind") == "ScaledObject"]
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)
    assert hpa["apiVersion"] == "autoscaling/v2" and keda["apiVersion"] == "keda.sh/v1alpha1"
    for scaler, low, high in (
        (hpa, hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]),
        (keda, keda["spec"]["minReplicaCount"], keda["spec"]["maxReplicaCount"]),
    ):
        ref = scaler["spec"]["scaleTargetRef"]
        assert {k: ref[k] for k in ("apiVersion", "kind")} == TARGET
        server = servers[ref["name"]]
        assert server["metadata"]["namespace"] == scaler["metadata"]["namespace"]
        validate_custom(copy.deepcopy(server), crds)
        scaling = parse_spec(server["spec"]).scaling
        assert scaling.mode == "External", "an HPA on a ModelServer in mode Operator is put back"
        assert scaling.min_replicas <= low <= high <= scaling.max_replicas, "within the bounds"
    assert "replicas" not in servers[hpa["spec"]["scaleTargetRef"]["name"]]["spec"], "the HPA's field"


def test_every_documented_modelserver_passes_the_crd_and_the_operator(crds: dict) -> None:
    servers = [o for o in doc_objects() if o.get("kind") == "ModelServer"]
    assert any("cache" in s["spec"] for s in servers), "the spec.cache example"
    for server in servers:
        validate_custom(copy.deepcopy(server), crds)
        parse_spec(server["spec"])
