"""The objects a ModelServer owns: its Deployment, Service and PodDisruptionBudget (plain dicts)."""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ModelServerSpec

GRPC_PORT = 50051  # DESIGN.md section 4
HEALTH_PORT = 50052  # plaintext grpc.health.v1 under TLS: the kubelet's gRPC probes cannot speak TLS
HTTP_PORT = 8000  # the OpenAI-compatible HTTP API (spec.openaiApi)
DRAIN_MARGIN_S = 30  # grace period beyond the server's own drain timeout
PRESTOP_SLEEP_S = 5  # let endpoint removal reach the proxies before the server stops accepting
STARTUP_PERIOD_S = 10
MODEL_LABEL = "tandem.dev/modelserver"
SERVER_GID = 10001  # the server image's group (Dockerfile): mounted Secret files and cache claims get it
SECRET_MODE = 0o440  # owner and group read: the key and the tokens are for the server alone
TLS_DIR, CLIENT_CA_DIR, AUTH_DIR = "/etc/tandem/tls", "/etc/tandem/client-ca", "/etc/tandem/auth"
# Requests when spec.resources names none for cpu or memory: a pod with no requests is BestEffort,
# the first to be evicted. A GPU pod's host side tokenizes, detokenizes and feeds the device
# (a few cores) and holds the weights in memory while loading them; a CPU pod runs small models.
DEFAULT_REQUESTS = {"cpu": "4", "memory": "16Gi"}
CPU_POD_REQUESTS = {"cpu": "2", "memory": "4Gi"}


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


def selector_string(name: str) -> str:
    """The pods' label selector as a string: the ModelServer's status.selector, which the scale
    subresource hands to an HPA (labelSelectorPath) to find the pods it averages metrics over."""
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


@dataclass(frozen=True)
class SecretFiles:
    """A Secret mounted as a read-only directory, and the settings naming its files.

    Never through subPath: the kubelet updates a directory volume when the Secret changes (a
    certificate cert-manager renews, a token added), a subPath file never, and the server re-reads
    the files when they change. The operator only names the Secret; the kubelet reads it, so the
    operator needs no access to Secrets and a missing one keeps the pod pending.
    """

    volume: str
    secret: str
    directory: str
    files: dict[str, tuple[str, str]]  # setting -> (key in the Secret, file name)

    def volume_source(self) -> dict:
        items = [{"key": key, "path": path} for key, path in self.files.values()]
        source = {"secretName": self.secret, "items": items, "defaultMode": SECRET_MODE}
        return {"name": self.volume, "secret": source}

    def mount(self) -> dict:
        return {"name": self.volume, "mountPath": self.directory, "readOnly": True}

    def env(self) -> dict[str, str]:
        return {setting: f"{self.directory}/{path}" for setting, (_, path) in self.files.items()}


def secret_files(spec: ModelServerSpec) -> list[SecretFiles]:
    out = []
    if spec.tls:
        cert = {"TANDEM_TLS_CERT_FILE": ("tls.crt", "tls.crt"), "TANDEM_TLS_KEY_FILE": ("tls.key", "tls.key")}
        out.append(SecretFiles("tls", spec.tls.secret_name, TLS_DIR, cert))
        if spec.tls.client_ca_secret_name:
            ca = {"TANDEM_TLS_CLIENT_CA_FILE": ("ca.crt", "ca.crt")}
            out.append(SecretFiles("client-ca", spec.tls.client_ca_secret_name, CLIENT_CA_DIR, ca))
    if spec.auth:
        tokens = {"TANDEM_AUTH_TOKEN_FILE": (spec.auth.token_key, "tokens")}
        out.append(SecretFiles("auth", spec.auth.token_secret_name, AUTH_DIR, tokens))
    return out


def probe_port(spec: ModelServerSpec) -> int:
    """Where the kubelet asks grpc.health.v1: the plaintext health port once gRPC speaks TLS only
    (a bearer token alone does not move it: health needs no token)."""
    return HEALTH_PORT if spec.tls else GRPC_PORT


def _security_env(spec: ModelServerSpec) -> dict[str, str]:
    env: dict[str, str] = {}
    for secret in secret_files(spec):
        env.update(secret.env())
    if spec.tls:
        env["TANDEM_HEALTH_PORT"] = str(HEALTH_PORT)
    if not spec.reflection:  # on is the server's default: left unset, as before the field existed
        env["TANDEM_REFLECTION"] = "false"
    return env


def _env(spec: ModelServerSpec, metrics_port: int) -> list[dict]:
    env = {
        "TANDEM_HOST": "0.0.0.0",
        "TANDEM_PORT": str(GRPC_PORT),
        "TANDEM_HTTP_PORT": str(HTTP_PORT if spec.openai_api else 0),
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
    # Only what differs from the server's defaults: a pod template that gained a variable would roll
    # every ModelServer's pods when the operator is upgraded, though none of them changed
    if spec.quantization:  # unset: as the checkpoint is
        env["TANDEM_QUANTIZATION"] = spec.quantization
    if spec.kv_cache_dtype != "auto":
        env["TANDEM_KV_CACHE_DTYPE"] = spec.kv_cache_dtype
    env.update(_security_env(spec))
    for var in spec.env:  # the user's word wins
        env[var.name] = var.value
    return [{"name": k, "value": v} for k, v in env.items()]


def _resources(spec: ModelServerSpec) -> dict:
    resources = {k: dict(v) for k, v in spec.resources.items() if isinstance(v, dict)}
    requests, limits = resources.setdefault("requests", {}), resources.get("limits", {})
    for name, value in (DEFAULT_REQUESTS if spec.gpus_per_pod else CPU_POD_REQUESTS).items():
        # the user's word wins: a limit alone is the request too (Kubernetes copies it over)
        if name not in requests and name not in limits:
            requests[name] = value
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


def _container_ports(spec: ModelServerSpec, metrics_port: int) -> list[dict]:
    ports = [
        {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
    ]
    if spec.tls:
        ports.append({"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"})
    if spec.openai_api:
        ports.append({"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"})
    return ports


def cache_volume(spec: ModelServerSpec) -> dict:
    """The /cache volume of spec.cache. Unset, or an emptyDir without options, is `emptyDir: {}` as
    before the field existed, so an operator upgrade changes no pod template."""
    cache = spec.cache
    if cache and cache.host_path:
        # The kubelet creates a missing directory owned by root (0755) and never applies fsGroup to a
        # hostPath: the node's directory must already be writable by the server's uid (docs/operator.md)
        return {"name": "cache", "hostPath": {"path": cache.host_path.path, "type": "DirectoryOrCreate"}}
    if cache and cache.persistent_volume_claim:
        claim = cache.persistent_volume_claim.claim_name
        return {"name": "cache", "persistentVolumeClaim": {"claimName": claim}}
    empty_dir = cache.empty_dir if cache else None
    source: dict = {}
    if empty_dir and empty_dir.medium:
        source["medium"] = empty_dir.medium
    if empty_dir and empty_dir.size_limit:
        source["sizeLimit"] = empty_dir.size_limit
    return {"name": "cache", "emptyDir": source}


def _pod_security(spec: ModelServerSpec) -> dict:
    context: dict = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    cache_claim = spec.cache is not None and spec.cache.persistent_volume_claim is not None
    if secret_files(spec) or cache_claim:
        # the kubelet gives the Secret files this group (mode 0440), so the non-root server reads them,
        # and a claim's fresh (root-owned) volume group write access, so the server can fill it
        context["fsGroup"] = SERVER_GID
        context["fsGroupChangePolicy"] = "OnRootMismatch"  # no recursive walk of the volumes per start
    return context


def deployment(name: str, spec: ModelServerSpec, metrics_port: int) -> dict:
    # The root filesystem is read-only: the server writes only its caches (/cache: converted models,
    # Hugging Face, Triton, Inductor, compiled graphs, as the image's environment says) and temporary files.
    volumes: list[dict] = [cache_volume(spec), {"name": "tmp", "emptyDir": {}}]
    mounts: list[dict] = [{"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.persistent_volume_claim:
        volumes.append(
            {
                "name": "models",
                "persistentVolumeClaim": {"claimName": spec.model.persistent_volume_claim, "readOnly": True},
            }
        )
        mounts.append({"name": "models", "mountPath": spec.model.mount_path, "readOnly": True})
    secrets = secret_files(spec)
    volumes += [s.volume_source() for s in secrets]
    mounts += [s.mount() for s in secrets]
    grpc_check = {"grpc": {"port": probe_port(spec)}}  # grpc.health.v1; the kubelet needs a numeric port
    container = {
        "name": "server",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": ["serve"],
        "env": _env(spec, metrics_port),
        "ports": _container_ports(spec, metrics_port),
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
            "replicas": spec.initial_replicas(),
            "selector": {"matchLabels": selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(name)},
                "spec": {
                    "terminationGracePeriodSeconds": spec.drain_seconds + PRESTOP_SLEEP_S + DRAIN_MARGIN_S,
                    "securityContext": _pod_security(spec),
                    "automountServiceAccountToken": False,  # the server never calls the API
                    "containers": [container],
                    "volumes": volumes,
                    **_scheduling(spec),
                },
            },
        },
    }


def service(name: str, spec: ModelServerSpec, metrics_port: int) -> dict:
    ports = [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "grpc"},
        {"name": "metrics", "port": metrics_port, "targetPort": "metrics"},
    ]
    if spec.tls:  # health checks from inside the cluster (the helm test) cannot speak TLS either
        ports.append({"name": "health", "port": HEALTH_PORT, "targetPort": "health", "appProtocol": "grpc"})
    if spec.openai_api:  # HTTP/1.1, TLS too when spec.tls is set
        ports.append({"name": "http", "port": HTTP_PORT, "targetPort": "http", "appProtocol": "http"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector(name),
            "ports": ports,
        },
    }


def pod_disruption_budget(name: str) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}},
    }
