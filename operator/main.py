"""`tandem operator`: run the kopf operator with the handlers of handlers.py, alone or, with
leader election, only while this replica holds the leader Lease (leader.py); its own /metrics
(metrics.py) are served all along, so a standby says it is one."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from pathlib import Path

import kopf

from .handlers import Shared, connection_info, registry
from .kube import KubeApi
from .leader import LeaderElector, LeadershipLost
from .metrics import MetricsPortError, OperatorMetrics, serve
from .settings import OperatorSettings

log = logging.getLogger("tandem.operator")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


async def _kopf(settings: OperatorSettings, shared: Shared, stop_flag: asyncio.Event) -> None:
    namespaces = settings.namespace_list()
    port = settings.liveness_port
    await kopf.operator(
        registry=registry,
        memo=kopf.Memo(shared=shared),
        standalone=True,  # no kopf peering: the Lease decides who acts
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=f"http://0.0.0.0:{port}/healthz" if port else None,
        stop_flag=stop_flag,
    )


def lease_namespace(settings: OperatorSettings) -> str:
    if settings.leader_election_namespace:
        return settings.leader_election_namespace
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


async def run_operator(settings: OperatorSettings, stop_flag: asyncio.Event | None = None) -> None:
    """Run until `stop_flag` is set; with leader election, raise LeadershipLost when the Lease
    could not be renewed (the caller exits: a new process is a candidate again)."""
    stop = stop_flag or asyncio.Event()
    metrics = OperatorMetrics()
    server = await serve(metrics, settings.prometheus_port) if settings.prometheus_port else None
    try:
        if not settings.leader_election:
            metrics.leading(None)
            await _kopf(settings, Shared(settings, metrics=metrics), stop)
            return
        await _elected(settings, metrics, stop)
    finally:
        if server is not None:
            await server.cleanup()


async def _elected(settings: OperatorSettings, metrics: OperatorMetrics, stop: asyncio.Event) -> None:
    info = connection_info(settings, logger=log, settings=kopf.OperatorSettings())
    if info is None:
        raise RuntimeError("no credentials for the Kubernetes API (service account or kubeconfig)")
    identity = settings.leader_election_identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    api = KubeApi(info)
    elector = LeaderElector(
        api, lease_namespace(settings), settings.leader_election_lease, identity, settings.timings()
    )
    metrics.leading(elector.leading)
    shared = Shared(settings, leading=elector.leading, metrics=metrics)
    try:
        await elector.run(lambda: _kopf(settings, shared, stop), stop)
    finally:
        await api.close()


def main(settings: OperatorSettings) -> int:
    kopf.configure(verbose=settings.log_level == "DEBUG", log_prefix=True)
    logging.getLogger().setLevel(settings.log_level)
    try:
        asyncio.run(run_operator(settings))
    except LeadershipLost as exc:
        log.error(f"{exc}: exiting, to start again as a candidate")
        return 1
    except MetricsPortError as exc:
        log.error(str(exc))
        return 1
    return 0
