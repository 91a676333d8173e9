"""The ModelServer spec, parsed and checked (the same rules as the CRD's schema and CEL rule).

The API server enforces the schema when the CRD is installed; the operator checks again so a
spec that slipped past (an older CRD, a cluster without CEL, a test API) gets a clear status
condition instead of a crash loop.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from .policy import ScalingTargets


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class ModelSource(_Camel):
    source: str | None = None
    name: str | None = None
    persistent_volume_claim: str | None = None
    mount_path: str = "/models"


class EnvVar(_Camel):
    name: str = Field(min_length=1)
    value: str = ""


# A Secret's name (a DNS subdomain) and a key in it (mounted as a file of that name)
SECRET_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
_NAME = {"min_length": 1, "max_length": 253, "pattern": SECRET_NAME}


class TLS(_Camel):
    # a kubernetes.io/tls Secret (tls.crt, tls.key), as cert-manager writes it
    secret_name: str = Field(**_NAME)
    # a Secret with ca.crt: clients must present a certificate it signed (mutual TLS)
    client_ca_secret_name: str | None = Field(None, alias="clientCASecretName", **_NAME)


class Auth(_Camel):
    # a Secret whose key token_key holds the accepted bearer tokens, one per line
    token_secret_name: str = Field(**_NAME)
    token_key: str = Field("tokens", min_length=1, max_length=253, pattern=SECRET_KEY)


# A Kubernetes resource.Quantity without a sign (20Gi, 500M, 1e9), as the API server parses one
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY = rf"^{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?$"


class EmptyDirCache(_Camel):
    size_limit: str | None = Field(None, pattern=QUANTITY)
    medium: Literal["", "Memory"] = ""  # Memory: a tmpfs, counted against the pod's memory limit

    @field_validator("size_limit", mode="before")
    @classmethod
    def _quantity(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a Quantity may be a plain integer (bytes), as in a Pod spec
        if isinstance(value, str) and not re.match(QUANTITY, value):
            # said here: the pattern's own message is unreadable
            raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 20Gi, 500M)")
        return value


class HostPathCache(_Camel):
    path: str = Field(pattern=r"^/")

    @field_validator("path", mode="before")
    @classmethod
    def _absolute(cls, value: object) -> object:
        # the API server would refuse the pods, which only the ReplicaSet's Events would tell
        if isinstance(value, str) and not value.startswith("/"):
            raise ValueError(f"{value!r} is not an absolute path")
        if isinstance(value, str) and ".." in value.split("/"):
            raise ValueError(f"{value!r} must not contain '..'")
        return value


class PersistentVolumeClaimCache(_Camel):
    claim_name: str = Field(**_NAME)  # a claim the user made: the operator never creates one


class Cache(_Camel):
    """The pods' /cache volume (compiled artefacts, converted models): exactly one source."""

    empty_dir: EmptyDirCache | None = None
    host_path: HostPathCache | None = None
    persistent_volume_claim: PersistentVolumeClaimCache | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Cache:
        given = [alias for alias, source in self.sources().items() if source is not None]
        if len(given) != 1:
            names = ", ".join(self.sources())
            raise ValueError(f"set exactly one of {names} (given: {', '.join(given) or 'none'})")
        return self

    def sources(self) -> dict[str, _Camel | None]:
        return {
            "emptyDir": self.empty_dir,
            "hostPath": self.host_path,
            "persistentVolumeClaim": self.persistent_volume_claim,
        }


# Who sets the replica count: the operator's own policy, or something outside it (an HPA, KEDA,
# `kubectl scale`) through the scale subresource, i.e. spec.replicas.
ScalingMode = Literal["Operator", "External"]
# The server's TANDEM_QUANTIZATION and TANDEM_KV_CACHE_DTYPE (service/settings.py): the same choices
Quantization = Literal["fp8"]
KvCacheDtype = Literal["auto", "fp8"]


class Scaling(_Camel):
    mode: ScalingMode = "Operator"
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_time_to_first_token_seconds: float = Field(1.0, gt=0)
    cost_ceiling_per_million_tokens_usd: float | None = Field(None, gt=0)
    target_batch_fill: float = Field(0.8, gt=0, le=1)
    target_capacity_utilization: float = Field(0.7, gt=0, le=1)
    scale_down_idle_fraction: float = Field(0.5, ge=0, le=1)
    scale_up_stabilization_seconds: int = Field(0, ge=0)
    # unset: as many pod starts as the policy measured (policy.scale_down_window_s)
    scale_down_stabilization_seconds: int | None = Field(None, ge=0)
    max_scale_up_step: int = Field(4, ge=1)
    max_scale_down_step: int = Field(2, ge=1)
    metrics_window_seconds: int = Field(60, ge=1)
    burst_headroom: bool = True
    pod_start_seconds: int = Field(120, ge=1, le=1800)

    @model_validator(mode="after")
    def _bounds(self) -> Scaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        return self

    def bounded(self, replicas: int) -> int:
        """`replicas` within minReplicas-maxReplicas: the bounds hold whoever scales."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


# The engine uses one device per process; 0 = CPU pods.
MAX_GPUS_PER_POD = 1


class ModelServerSpec(_Camel):
    image: str = Field(min_length=1)
    image_pull_policy: str = "IfNotPresent"
    model: ModelSource = ModelSource()
    gpus_per_pod: int = Field(1, ge=0)  # at most MAX_GPUS_PER_POD, with a message of its own
    gpu_resource_name: str = "nvidia.com/gpu"
    price_per_gpu_hour: float = Field(0.0, ge=0)
    resources: dict = Field(default_factory=dict)
    # GPU-node scheduling of the model pods, passed to the pod spec as given
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict] = Field(default_factory=list)
    affinity: dict = Field(default_factory=dict)
    image_pull_secrets: list[dict] = Field(default_factory=list)
    # The scale subresource's spec.replicas: written by the operator in mode Operator, by an
    # external scaler in mode External; unset until either writes it. 0 is accepted (KEDA's
    # scale to zero) and raised to minReplicas, like any value outside the bounds.
    replicas: int | None = Field(None, ge=0)
    env: list[EnvVar] = Field(default_factory=list)
    max_num_seqs: int = Field(256, ge=1)
    quantization: Quantization | None = None  # None: as the checkpoint is
    kv_cache_dtype: KvCacheDtype = "auto"
    drain_seconds: int = Field(600, ge=0)
    cache: Cache | None = None  # None: an emptyDir of each pod's own, as before the field existed
    startup_seconds: int = Field(1800, ge=10)
    scaling: Scaling = Scaling()
    tls: TLS | None = None
    auth: Auth | None = None
    reflection: bool = True
    openai_api: bool = True  # the OpenAI-compatible HTTP API on HTTP_PORT

    @field_validator("gpus_per_pod")
    @classmethod
    def _one_gpu(cls, value: int) -> int:
        if value > MAX_GPUS_PER_POD:
            raise ValueError(
                f"{value} GPUs per pod: the engine runs a model on one GPU (no tensor parallelism "
                f"yet), so at most {MAX_GPUS_PER_POD}; more would be paid for and left idle"
            )
        return value

    def initial_replicas(self) -> int:
        """Pods of a new Deployment: spec.replicas within the bounds, else minReplicas."""
        return self.scaling.bounded(self.replicas if self.replicas is not None else self.scaling.min_replicas)

    def targets(self) -> ScalingTargets:
        s = self.scaling
        return ScalingTargets(
            min_replicas=s.min_replicas,
            max_replicas=s.max_replicas,
            target_ttft_s=s.target_time_to_first_token_seconds,
            cost_ceiling_usd_per_mtok=s.cost_ceiling_per_million_tokens_usd,
            target_batch_fill=s.target_batch_fill,
            target_utilization=s.target_capacity_utilization,
            scale_down_idle_fraction=s.scale_down_idle_fraction,
            scale_up_stabilization_s=s.scale_up_stabilization_seconds,
            scale_down_stabilization_s=s.scale_down_stabilization_seconds,
            max_scale_up_step=s.max_scale_up_step,
            max_scale_down_step=s.max_scale_down_step,
            max_num_seqs=self.max_num_seqs,
            pod_start_s=float(s.pod_start_seconds),
            burst_headroom=s.burst_headroom,
        )


class InvalidSpec(ValueError):
    """The spec breaks a rule; the message names each problem by its spec path."""


def parse_spec(spec: dict) -> ModelServerSpec:
    try:
        return ModelServerSpec.model_validate(dict(spec))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            path = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"spec.{path}: {msg}" if path else f"spec: {msg}")
        raise InvalidSpec("; ".join(problems)) from None
