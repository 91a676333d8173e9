"""The objects a ModelServer owns: its Deployment, Service and PodDisruptionBudget (plain dicts)."""

from __future__ import annotations

from .spec import ModelServerSpec

GRPC_PORT = 50051  # DESIGN.md section 4
DRAIN_MARGIN_S = 30  # grace period beyond the server's own drain timeout
PRESTOP_SLEEP_S = 5  # let endpoint removal reach the proxies before the server stops accepting
STARTUP_PERIOD_S = 10
MODEL_LABEL = "tandem.dev/modelserver"


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "model-server",
        "app.kubernetes.io/managed-by": "tandem-operator",
        MODEL_LABEL: name,
    }


def selector(name: str) -> dict[str, str]:
    return {MODEL_LABEL: name}


def _env(spec: ModelServerSpec, metrics_port: int) -> list[dict]:
    env = {
        "TANDEM_HOST": "0.0.0.0",
        "TANDEM_PORT": str(GRPC_PORT),
        "TANDEM_METRICS_PORT": str(metrics_port),
        "TANDEM_MAX_NUM_SEQS": str(spec.max_num_seqs),
        "TANDEM_DRAIN_TIMEOUT_S": str(spec.drain_seconds),
        "TANDEM_PRICE_PER_GPU_HOUR": str(spec.price_per_gpu_hour),
        "TANDEM_NUM_GPUS": str(spec.gpus_per_pod),
        "TANDEM_CACHE_DIR": "/cache",
    }
    if spec.model.source:
        env["TANDEM_MODEL"] = spec.model.source
    if spec.model.name:
        env["TANDEM_MODEL_NAME"] = spec.model.name
    for var in spec.env:  # the user's word wins
        env[var.name] = var.value
    return [{"name": k, "value": v} for k, v in env.items()]


def _resources(spec: ModelServerSpec) -> dict:
    resources = {k: dict(v) for k, v in spec.resources.items() if isinstance(v, dict)}
    if spec.gpus_per_pod:
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[spec.gpu_resource_name] = spec.gpus_per_pod
    return resources


def _scheduling(spec: ModelServerSpec) -> dict:
    """Where the pods may run and how their image is pulled: only the fields the spec sets."""
    fields = {
        "nodeSelector": spec.node_selector,
        "tolerations": spec.tolerations,
        "affinity": spec.affinity,
        "imagePullSecrets": [{"name": s["name"]} for s in spec.image_pull_secrets],
    }
    return {k: v for k, v in fields.items() if v}


def deployment(name: str, spec: ModelServerSpec, metrics_port: int) -> dict:
    # The root filesystem is read-only: the server writes only its caches (/cache: converted models,
    # Hugging Face, Triton, Inductor, as the image's environment says) and temporary files.
    volumes: list[dict] = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts: list[dict] = [{"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.persistent_volume_claim:
        volumes.append(
            {
                "name": "models",
                "persistentVolumeClaim": {"claimName": spec.model.persistent_volume_claim, "readOnly": True},
            }
        )
        mounts.append({"name": "models", "mountPath": spec.model.mount_path, "readOnly": True})
    grpc_check = {"grpc": {"port": GRPC_PORT}}  # grpc.health.v1; the kubelet needs a numeric port
    container = {
        "name": "server",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": ["serve"],
        "env": _env(spec, metrics_port),
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
        ],
        "startupProbe": {
            **grpc_check,
            "periodSeconds": STARTUP_PERIOD_S,
            "failureThreshold": max(1, -(-spec.startup_seconds // STARTUP_PERIOD_S)),
        },
        "readinessProbe": {**grpc_check, "periodSeconds": 5, "failureThreshold": 2},
        # /healthz stays 200 while the server drains: liveness must not kill a finishing pod
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": metrics_port},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "securityContext": {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "replicas": spec.scaling.min_replicas,
            "selector": {"matchLabels": selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(name)},
                "spec": {
                    "terminationGracePeriodSeconds": spec.drain_seconds + PRESTOP_SLEEP_S + DRAIN_MARGIN_S,
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "automountServiceAccountToken": False,  # the server never calls the API
                    "containers": [container],
                    "volumes": volumes,
                    **_scheduling(spec),
                },
            },
        },
    }


def service(name: str, metrics_port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector(name),
            "ports": [
                {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "grpc"},
                {"name": "metrics", "port": metrics_port, "targetPort": "metrics"},
            ],
        },
    }


def pod_disruption_budget(name: str) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}},
    }
