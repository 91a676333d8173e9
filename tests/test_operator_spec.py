"""The ModelServer spec: the operator's checks agree with the CRD, and the owned objects' shape."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
import yaml

from tandem.operator import resources
from tandem.operator.spec import (
    MAX_GPUS_PER_POD,
    TLS,
    Auth,
    Cache,
    EmptyDirCache,
    HostPathCache,
    InvalidSpec,
    ModelServerSpec,
    PersistentVolumeClaimCache,
    Scaling,
    parse_spec,
)

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
    assert version["name"] == "v1alpha1"
    # the scale subresource: `kubectl scale`, an HPA or KEDA set spec.replicas; status.selector
    # tells an HPA which pods are the ModelServer's
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Replicas"] == ".status.replicas" and columns["Idle"] == ".status.idleFraction"
    assert columns["$/Mtok"] == ".status.costPerMillionTokensUsd" and "Age" in columns
    rules = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["scaling"]
    assert rules["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"


def test_one_gpu_per_pod_at_most_in_the_crd_and_the_operator():
    gpus = crd_schema()["properties"]["gpusPerPod"]
    assert (gpus["minimum"], gpus["maximum"]) == (0, MAX_GPUS_PER_POD) == (0, 1)
    assert parse_spec({"image": "x", "gpusPerPod": 0}).gpus_per_pod == 0  # CPU pods stay allowed
    with pytest.raises(InvalidSpec, match="at most 1"):
        parse_spec({"image": "x", "gpusPerPod": 2})


def _constraint(field: object, name: str) -> object:
    """A pydantic field's bound of that name (ge, gt, max_length, pattern), or None."""
    return next((getattr(m, name) for m in field.metadata if getattr(m, name, None) is not None), None)


@pytest.mark.parametrize(
    ("model", "path"),
    [
        (ModelServerSpec, ()),
        (Scaling, ("scaling",)),
        (TLS, ("tls",)),
        (Auth, ("auth",)),
        (Cache, ("cache",)),
        (EmptyDirCache, ("cache", "emptyDir")),
        (HostPathCache, ("cache", "hostPath")),
        (PersistentVolumeClaimCache, ("cache", "persistentVolumeClaim")),
    ],
)
def test_crd_defaults_and_fields_match_the_operator(model: type, path: tuple[str, ...]):
    schema = crd_schema()
    for key in path:
        schema = schema["properties"][key]
    props = schema["properties"]
    aliases = {f.alias or n: f for n, f in model.model_fields.items()}
    assert set(props) == set(aliases)  # no field only one side knows
    required = {name for name, field in aliases.items() if field.is_required()}
    assert set(schema.get("required", [])) == required
    for name, field in aliases.items():
        if "default" in props[name] and not isinstance(props[name]["default"], dict):
            assert props[name]["default"] == field.default, name
        if "minimum" in props[name]:
            low = _constraint(field, "ge")
            if low is None:
                low = _constraint(field, "gt")
            assert low == props[name]["minimum"], name
        for crd_key, pydantic_key in (
            ("minLength", "min_length"),
            ("maxLength", "max_length"),
            ("pattern", "pattern"),
        ):
            assert props[name].get(crd_key) == _constraint(field, pydantic_key), (name, crd_key)


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
        (
            {"image": "x", "gpusPerPod": 2},
            "spec.gpusPerPod: 2 GPUs per pod: the engine runs a model on one GPU",
        ),
        ({}, "spec.image: Field required"),
        ({"image": "x", "tls": {}}, "spec.tls.secretName: Field required"),
        ({"image": "x", "tls": {"secretName": "Server_TLS"}}, "spec.tls.secretName: String should match"),
        ({"image": "x", "tls": {"secretName": "a", "clientCASecretName": ""}}, "spec.tls.clientCASecretName"),
        ({"image": "x", "auth": {"tokenKey": "tokens"}}, "spec.auth.tokenSecretName: Field required"),
        ({"image": "x", "auth": {"tokenSecretName": "t", "tokenKey": "../etc"}}, "spec.auth.tokenKey"),
        ({"image": "x", "quantization": "int4"}, "spec.quantization: Input should be 'fp8'"),
        ({"image": "x", "kvCacheDtype": "fp16"}, "spec.kvCacheDtype: Input should be 'auto' or 'fp8'"),
        (
            {"image": "x", "cache": {}},
            "spec.cache: set exactly one of emptyDir, hostPath, persistentVolumeClaim (given: none)",
        ),
        (
            {"image": "x", "cache": {"emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}},
            "spec.cache: set exactly one of emptyDir, hostPath, persistentVolumeClaim "
            "(given: emptyDir, persistentVolumeClaim)",
        ),
        (
            {"image": "x", "cache": {"emptyDir": {"sizeLimit": "50GB"}}},
            "spec.cache.emptyDir.sizeLimit: '50GB' is not a Kubernetes quantity",
        ),
        ({"image": "x", "cache": {"emptyDir": {"sizeLimit": "-1Gi"}}}, "spec.cache.emptyDir.sizeLimit"),
        ({"image": "x", "cache": {"emptyDir": {"sizeLimit": 1.5}}}, "spec.cache.emptyDir.sizeLimit"),
        ({"image": "x", "cache": {"emptyDir": {"medium": "HugePages"}}}, "spec.cache.emptyDir.medium"),
        ({"image": "x", "cache": {"hostPath": {}}}, "spec.cache.hostPath.path: Field required"),
        (
            {"image": "x", "cache": {"hostPath": {"path": "var/cache"}}},
            "spec.cache.hostPath.path: 'var/cache' is not an absolute path",
        ),
        (
            {"image": "x", "cache": {"hostPath": {"path": "/var/lib/../../etc"}}},
            "spec.cache.hostPath.path: '/var/lib/../../etc' must not contain '..'",
        ),
        (
            {"image": "x", "cache": {"persistentVolumeClaim": {}}},
            "spec.cache.persistentVolumeClaim.claimName: Field required",
        ),
        (
            {"image": "x", "cache": {"persistentVolumeClaim": {"claimName": "Model_Cache"}}},
            "spec.cache.persistentVolumeClaim.claimName: String should match",
        ),
    ],
)
def test_invalid_specs_name_their_problem(spec: dict, message: str):
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        parse_spec(spec)


def test_deployment_shape():
    spec = parse_spec(
        {
            "image": "tandem:1",
            "model": {"source": "/models/llama", "name": "llama", "persistentVolumeClaim": "weights"},
            "gpusPerPod": 1,
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
    assert env["TANDEM_NUM_GPUS"] == "1" and env["TANDEM_PRICE_PER_GPU_HOUR"] == "2.5"
    assert env["TANDEM_MAX_MODEL_LEN"] == "8192" and env["TANDEM_PORT"] == "1"  # the user's env wins
    # the user's memory request wins; the CPU request is the default of a GPU pod
    assert c["resources"] == {
        "requests": {"memory": "64Gi", "cpu": "4", "amd.com/gpu": 1},
        "limits": {"amd.com/gpu": 1},
    }
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
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": resources.CPU_POD_REQUESTS
    }


SECURE = {
    "image": "x",
    "tls": {"secretName": "llama-tls", "clientCASecretName": "clients-ca"},
    "auth": {"tokenSecretName": "llama-tokens", "tokenKey": "api-tokens"},
    "reflection": False,
}


def _pod(spec: dict) -> tuple[dict, dict]:
    pod = resources.deployment("llama", parse_spec(spec), 9400)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def test_tls_and_auth_mount_their_secrets_as_directories():
    pod, container = _pod(SECURE)
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert volumes == {
        "tls": {
            "secretName": "llama-tls",
            "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
            "defaultMode": 0o440,
        },
        "client-ca": {
            "secretName": "clients-ca",
            "items": [{"key": "ca.crt", "path": "ca.crt"}],
            "defaultMode": 0o440,
        },
        "auth": {
            "secretName": "llama-tokens",
            "items": [{"key": "api-tokens", "path": "tokens"}],
            "defaultMode": 0o440,
        },
    }
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for volume in volumes:
        # a subPath mount is never updated by the kubelet: a renewed certificate would not reach the server
        assert "subPath" not in mounts[volume] and mounts[volume]["readOnly"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TANDEM_TLS_CERT_FILE"] == mounts["tls"]["mountPath"] + "/tls.crt"
    assert env["TANDEM_TLS_KEY_FILE"] == mounts["tls"]["mountPath"] + "/tls.key"
    assert env["TANDEM_TLS_CLIENT_CA_FILE"] == mounts["client-ca"]["mountPath"] + "/ca.crt"
    assert env["TANDEM_AUTH_TOKEN_FILE"] == mounts["auth"]["mountPath"] + "/tokens"
    assert env["TANDEM_REFLECTION"] == "false"
    # 0440 files are the server's only through the group the kubelet gives them
    assert pod["securityContext"]["fsGroup"] == resources.SERVER_GID


def test_tls_moves_the_probes_to_the_plaintext_health_port():
    _, container = _pod(SECURE)
    env = {e["name"]: e["value"] for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == resources.HEALTH_PORT == int(env["TANDEM_HEALTH_PORT"]) != resources.GRPC_PORT
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": resources.HEALTH_PORT}
    service = resources.service("llama", parse_spec(SECURE), 9400)
    assert {
        "name": "health",
        "port": resources.HEALTH_PORT,
        "targetPort": "health",
        "appProtocol": "grpc",
    } in (service["spec"]["ports"])


def test_auth_alone_keeps_the_probes_on_the_grpc_port():
    """Health needs no token, and the kubelet's probe could not send one."""
    pod, container = _pod({"image": "x", "auth": {"tokenSecretName": "tokens"}})
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TANDEM_AUTH_TOKEN_FILE"] == "/etc/tandem/auth/tokens"
    assert [v["secret"]["items"] for v in pod["volumes"] if "secret" in v] == [
        [{"key": "tokens", "path": "tokens"}]
    ]
    assert not {"TANDEM_HEALTH_PORT", "TANDEM_TLS_CERT_FILE", "TANDEM_REFLECTION"} & set(env)
    assert container["readinessProbe"]["grpc"] == {"port": resources.GRPC_PORT}
    assert [p["name"] for p in container["ports"]] == ["grpc", "metrics", "http"]


def test_plain_spec_has_no_security_extras():
    pod, container = _pod({"image": "x", "reflection": True})
    assert [v["name"] for v in pod["volumes"]] == ["cache", "tmp"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert not [
        e for e in container["env"] if e["name"].startswith(("TANDEM_TLS", "TANDEM_AUTH", "TANDEM_HEALTH"))
    ]
    ports = resources.service("llama", parse_spec({"image": "x"}), 9400)["spec"]["ports"]
    assert [p["name"] for p in ports] == ["grpc", "metrics", "http"]


def test_the_openai_http_api_is_on_port_8000_unless_turned_off():
    """Container port, Service port and TANDEM_HTTP_PORT agree; spec.openaiApi: false removes all three
    (probes stay on gRPC either way: its health is what HTTP /ready follows)."""
    _, container = _pod({"image": "x"})
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TANDEM_HTTP_PORT"] == str(resources.HTTP_PORT) == "8000"
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    ports = resources.service("llama", parse_spec({"image": "x"}), 9400)["spec"]["ports"]
    assert {"name": "http", "port": 8000, "targetPort": "http", "appProtocol": "http"} in ports
    assert "grpc" in container["readinessProbe"]
    _, off = _pod({"image": "x", "openaiApi": False})
    assert {e["name"]: e["value"] for e in off["env"]}["TANDEM_HTTP_PORT"] == "0"
    assert "http" not in [p["name"] for p in off["ports"]]
    ports = resources.service("llama", parse_spec({"image": "x", "openaiApi": False}), 9400)["spec"]["ports"]
    assert [p["name"] for p in ports] == ["grpc", "metrics"]


@pytest.mark.parametrize(
    ("given", "gpus", "requests", "limits"),
    [
        ({}, 1, {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1}, {"nvidia.com/gpu": 1}),
        ({}, 0, {"cpu": "2", "memory": "4Gi"}, None),
        # a request or a limit the user gives wins (a limit alone is the request too)
        (
            {"requests": {"cpu": "500m"}, "limits": {"memory": "8Gi"}},
            1,
            {"cpu": "500m", "nvidia.com/gpu": 1},
            {"memory": "8Gi", "nvidia.com/gpu": 1},
        ),
    ],
)
def test_model_pods_get_default_cpu_and_memory_requests(given, gpus, requests, limits):
    spec = parse_spec({"image": "x", "gpusPerPod": gpus, "resources": given})
    (c,) = resources.deployment("m", spec, 9400)["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["requests"] == requests
    assert c["resources"].get("limits") == limits


def test_quantization_and_kv_cache_dtype_have_the_servers_choices_in_the_crd_and_the_operator():
    from tandem.service.settings import ServerSettings

    props = crd_schema()["properties"]
    server = ServerSettings.model_fields
    quantization, _none = get_args(server["quantization"].annotation)  # Literal["fp8"] | None
    assert props["quantization"]["enum"] == ["fp8"] == list(get_args(quantization))
    assert "default" not in props["quantization"], "unset: as the checkpoint is"
    kv_cache_dtypes = list(get_args(server["kv_cache_dtype"].annotation))
    assert props["kvCacheDtype"]["enum"] == ["auto", "fp8"] == kv_cache_dtypes
    assert props["kvCacheDtype"]["default"] == server["kv_cache_dtype"].default == "auto"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            {"quantization": "fp8", "kvCacheDtype": "fp8"},
            {"TANDEM_QUANTIZATION": "fp8", "TANDEM_KV_CACHE_DTYPE": "fp8"},
        ),
        ({"quantization": "fp8"}, {"TANDEM_QUANTIZATION": "fp8"}),
        ({"kvCacheDtype": "fp8"}, {"TANDEM_KV_CACHE_DTYPE": "fp8"}),
        # the server's defaults are left unset: an operator upgrade changes no existing pod template
        ({"kvCacheDtype": "auto"}, {}),
        ({}, {}),
    ],
)
def test_quantization_and_kv_cache_dtype_reach_the_server_env(given: dict, expected: dict):
    _, container = _pod({"image": "x", **given})
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {k: v for k, v in env.items() if k in ("TANDEM_QUANTIZATION", "TANDEM_KV_CACHE_DTYPE")} == expected


def test_the_users_env_wins_over_the_kv_cache_dtype_field():
    _, container = _pod(
        {"image": "x", "kvCacheDtype": "fp8", "env": [{"name": "TANDEM_KV_CACHE_DTYPE", "value": "auto"}]}
    )
    env = [e for e in container["env"] if e["name"] == "TANDEM_KV_CACHE_DTYPE"]
    assert env == [{"name": "TANDEM_KV_CACHE_DTYPE", "value": "auto"}]


def test_the_cache_takes_exactly_one_source_in_the_crd_too():
    cache = crd_schema()["properties"]["cache"]
    assert (cache["minProperties"], cache["maxProperties"]) == (1, 1)
    assert set(cache["properties"]) == {"emptyDir", "hostPath", "persistentVolumeClaim"}
    assert "default" not in cache, "unset: an emptyDir, and no default written into stored objects"
    medium = cache["properties"]["emptyDir"]["properties"]["medium"]
    assert medium["enum"] == list(get_args(EmptyDirCache.model_fields["medium"].annotation))
    size_limit = cache["properties"]["emptyDir"]["properties"]["sizeLimit"]
    assert size_limit["x-kubernetes-int-or-string"] is True  # 50Gi or a number of bytes, as in a Pod


@pytest.mark.parametrize(
    ("given", "size_limit"), [("50Gi", "50Gi"), ("1.5T", "1.5T"), (1000000, "1000000"), ("1e9", "1e9")]
)
def test_cache_size_limits_are_kubernetes_quantities(given: object, size_limit: str):
    spec = parse_spec({"image": "x", "cache": {"emptyDir": {"sizeLimit": given}}})
    assert resources.cache_volume(spec) == {"name": "cache", "emptyDir": {"sizeLimit": size_limit}}


def test_an_unset_cache_leaves_the_pod_template_as_it_was():
    """Operators before spec.cache gave every pod `emptyDir: {}` on /cache; the same template now
    means an operator upgrade rolls no pods, and an emptyDir without options is no change either."""
    unset = resources.deployment("llama", parse_spec({"image": "x"}), 9400)
    pod = unset["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    (container,) = pod["containers"]
    assert container["volumeMounts"] == [
        {"name": "cache", "mountPath": "/cache"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    assert {"name": "TANDEM_CACHE_DIR", "value": "/cache"} in container["env"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    for same in ({"emptyDir": {}}, {"emptyDir": {"medium": ""}}):
        assert resources.deployment("llama", parse_spec({"image": "x", "cache": same}), 9400) == unset


CACHE_VOLUMES = [
    ({"emptyDir": {"sizeLimit": "50Gi"}}, {"emptyDir": {"sizeLimit": "50Gi"}}),
    (
        {"emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        {"emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
    ),
    (
        {"hostPath": {"path": "/var/lib/tandem/cache"}},
        {"hostPath": {"path": "/var/lib/tandem/cache", "type": "DirectoryOrCreate"}},
    ),
    # not read-only: the pods write to it; the claim is the user's, so no storage class or size here
    (
        {"persistentVolumeClaim": {"claimName": "tandem-cache"}},
        {"persistentVolumeClaim": {"claimName": "tandem-cache"}},
    ),
]


@pytest.mark.parametrize(("cache", "volume"), CACHE_VOLUMES)
def test_each_cache_source_becomes_the_cache_volume(cache: dict, volume: dict):
    pod, container = _pod({"image": "x", "cache": cache, "model": {"persistentVolumeClaim": "weights"}})
    assert pod["volumes"][0] == {"name": "cache", **volume}
    assert [v["name"] for v in pod["volumes"]] == ["cache", "tmp", "models"]  # one volume per source
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["cache"] == {"name": "cache", "mountPath": "/cache"}  # writable, where the image says
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TANDEM_CACHE_DIR"] == "/cache"
    # the pod stays locked down whatever the volume: non-root, read-only root filesystem
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_only_a_cache_claim_gets_the_servers_group():
    """A fresh claim's volume is root's: fsGroup lets the non-root server write it. An emptyDir is
    writable by anyone, and the kubelet never applies fsGroup to a hostPath: nothing to add there."""
    pod, _ = _pod({"image": "x", "cache": {"persistentVolumeClaim": {"claimName": "tandem-cache"}}})
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroup": resources.SERVER_GID,
        "fsGroupChangePolicy": "OnRootMismatch",  # no walk of a large cache at every start
    }
    for cache in ({"emptyDir": {"sizeLimit": "1Gi"}}, {"hostPath": {"path": "/var/lib/tandem"}}):
        pod, _ = _pod({"image": "x", "cache": cache})
        assert "fsGroup" not in pod["securityContext"], cache
