"""The ModelServer spec: the operator's checks agree with the CRD, and the owned objects' shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tandem.operator import resources
from tandem.operator.spec import InvalidSpec, ModelServerSpec, Scaling, parse_spec

CRD = Path(__file__).resolve().parent.parent / "charts/tandem/crds/modelservers.tandem.dev.yaml"


def crd_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_crd_names_and_subresources():
    crd = yaml.safe_load(CRD.read_text())
    assert crd["metadata"]["name"] == "modelservers.tandem.dev"
    assert crd["spec"]["names"]["kind"] == "ModelServer" and "ms" in crd["spec"]["names"]["shortNames"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Replicas"] == ".status.replicas" and columns["Idle"] == ".status.idleFraction"
    assert columns["$/Mtok"] == ".status.costPerMillionTokensUsd" and "Age" in columns
    rules = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["scaling"]
    assert rules["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"


@pytest.mark.parametrize("model", [ModelServerSpec, Scaling])
def test_crd_defaults_and_fields_match_the_operator(model: type):
    schema = crd_schema() if model is ModelServerSpec else crd_schema()["properties"]["scaling"]
    props = schema["properties"]
    aliases = {f.alias or n: f for n, f in model.model_fields.items()}
    assert set(props) == set(aliases)  # no field only one side knows
    for name, field in aliases.items():
        if "default" in props[name] and not isinstance(props[name]["default"], dict):
            assert props[name]["default"] == field.default, name
        if "minimum" in props[name]:
            bounds = {type(m).__name__: m for m in field.metadata}
            low = getattr(bounds.get("Ge"), "ge", None)
            if low is None:
                low = getattr(bounds.get("Gt"), "gt", None)
            assert low == props[name]["minimum"], name


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"image": "x", "scaling": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas 3 > maxReplicas 2"),
        (
            {"image": "x", "pricePerGpuHour": -1},
            "spec.pricePerGpuHour: Input should be greater than or equal to 0",
        ),
        ({"image": "x", "scaling": {"targetBatchFill": 1.5}}, "spec.scaling.targetBatchFill"),
        ({"image": "x", "gpusPerPod": -1}, "spec.gpusPerPod"),
        ({}, "spec.image: Field required"),
    ],
)
def test_invalid_specs_name_their_problem(spec: dict, message: str):
    with pytest.raises(InvalidSpec, match=message.replace(".", r"\.").replace("$", r"\$")):
        parse_spec(spec)


def test_deployment_shape():
    spec = parse_spec(
        {
            "image": "tandem:1",
            "model": {"source": "/models/llama", "name": "llama", "persistentVolumeClaim": "weights"},
            "gpusPerPod": 2,
            "gpuResourceName": "amd.com/gpu",
            "pricePerGpuHour": 2.5,
            "resources": {"requests": {"memory": "64Gi"}},
            "env": [{"name": "TANDEM_MAX_MODEL_LEN", "value": "8192"}, {"name": "TANDEM_PORT", "value": "1"}],
            "drainSeconds": 300,
            "startupSeconds": 905,
            "scaling": {"minReplicas": 2, "maxReplicas": 5},
        }
    )
    dep = resources.deployment("llama", spec, 9400)
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = dep["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 300 + resources.PRESTOP_SLEEP_S
    (c,) = pod["containers"]
    assert c["args"] == ["serve"] and c["image"] == "tandem:1"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TANDEM_MODEL"] == "/models/llama" and env["TANDEM_MODEL_NAME"] == "llama"
    assert env["TANDEM_NUM_GPUS"] == "2" and env["TANDEM_PRICE_PER_GPU_HOUR"] == "2.5"
    assert env["TANDEM_MAX_MODEL_LEN"] == "8192" and env["TANDEM_PORT"] == "1"  # the user's env wins
    assert c["resources"] == {"requests": {"memory": "64Gi", "amd.com/gpu": 2}, "limits": {"amd.com/gpu": 2}}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 905
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["weights"]
    assert (
        dep["spec"]["selector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_cpu_pods_request_no_gpu():
    dep = resources.deployment("small", parse_spec({"image": "x", "gpusPerPod": 0}), 9400)
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"] == {}
