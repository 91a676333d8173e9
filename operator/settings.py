"""Every operator setting: environment variables `TANDEM_OPERATOR_<NAME>`, overridden by CLI flags."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:  # leader.py imports the API client (kopf): settings must not need it
    from .leader import Timings

ENV_PREFIX = "TANDEM_OPERATOR_"


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    namespaces: str = Field(
        "",
        description="Comma-separated namespaces to serve (globs allowed); empty = all namespaces.",
    )
    leader_election: bool = Field(
        False,
        description="Act only while holding the leader Lease, so that of several replicas exactly one "
        "acts (the chart turns it on); off = this replica acts alone.",
    )
    leader_election_lease: str = Field(
        "tandem-operator", min_length=1, description="Name of the coordination.k8s.io Lease."
    )
    leader_election_namespace: str = Field(
        "",
        description="Namespace of the Lease; empty = the namespace of the pod's service account, "
        "else `default`.",
    )
    leader_election_identity: str = Field(
        "", description="This replica's holderIdentity in the Lease; empty = host name and a random suffix."
    )
    lease_duration_s: float = Field(
        15.0, gt=0, description="How long a Lease not renewed stays another replica's (client-go's default)."
    )
    renew_deadline_s: float = Field(
        10.0, gt=0, description="The leader stops acting when it could not renew the Lease for this long."
    )
    retry_period_s: float = Field(2.0, gt=0, description="How often the Lease is renewed or tried.")
    liveness_port: int = Field(
        8080, ge=0, le=65535, description="Port of the liveness endpoint GET /healthz (0 = off)."
    )
    prometheus_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the operator's own Prometheus GET /metrics (decisions, scrape failures, "
        "tick and reconcile times, replicas, leader); 0 = off. The chart serves it on 8081.",
    )
    api_server: str | None = Field(
        None,
        description="Kubernetes API URL without authentication (tests, kubectl proxy); unset = the "
        "in-cluster service account, else the current kubeconfig context.",
    )
    scrape_interval_s: float = Field(
        15.0, gt=0, description="How often each ModelServer's pods are scraped and a scaling decision made."
    )
    scrape_timeout_s: float = Field(5.0, gt=0, description="Time limit of one pod's /metrics request.")
    scrape_concurrency: int = Field(
        16, ge=1, description="Most /metrics requests in flight at once, over all ModelServers."
    )
    stale_after_s: float = Field(
        60.0, gt=0, description="Hold scaling when the newest pod metrics are older than this."
    )
    metrics_port: int = Field(9400, ge=1, le=65535, description="The model pods' Prometheus /metrics port.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")

    @model_validator(mode="after")
    def _lease_timings(self) -> OperatorSettings:
        if self.leader_election:
            self.timings().check()
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> OperatorSettings:
        if self.prometheus_port and self.prometheus_port == self.liveness_port:
            raise ValueError(f"prometheus_port and liveness_port are both {self.liveness_port}")
        return self

    def timings(self) -> Timings:
        from .leader import Timings

        return Timings(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    def namespace_list(self) -> list[str]:
        return [n.strip() for n in self.namespaces.split(",") if n.strip()]
