"""`tandem operator`: run the kopf operator with the handlers of handlers.py."""

from __future__ import annotations

import asyncio
import logging

import kopf

from .handlers import Shared, register
from .settings import OperatorSettings


async def run_operator(settings: OperatorSettings, stop_flag: asyncio.Event | None = None) -> None:
    registry = kopf.OperatorRegistry()
    register(registry, settings)
    namespaces = settings.namespace_list()
    port = settings.liveness_port
    await kopf.operator(
        registry=registry,
        memo=kopf.Memo(shared=Shared(settings)),
        standalone=not settings.peering,
        peering_name=settings.peering or None,
        priority=settings.priority,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=f"http://0.0.0.0:{port}/healthz" if port else None,
        stop_flag=stop_flag,
    )


def main(settings: OperatorSettings) -> int:
    kopf.configure(verbose=settings.log_level == "DEBUG", log_prefix=True)
    logging.getLogger().setLevel(settings.log_level)
    asyncio.run(run_operator(settings))
    return 0
