"""Kubernetes Events about a ModelServer, named as client-go names them (object name + unique suffix)."""

from __future__ import annotations

import secrets

from .conditions import now_iso
from .kube import KubeApi, api_path

COMPONENT = "tandem-operator"


async def post_event(api: KubeApi, owner: dict, type_: str, reason: str, message: str) -> None:
    meta = owner["metadata"]
    namespace = meta.get("namespace") or "default"
    now = now_iso()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": namespace},
        "involvedObject": {
            "apiVersion": owner.get("apiVersion"),
            "kind": owner.get("kind"),
            "name": meta["name"],
            "namespace": namespace,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    await api.create(api_path("v1", "events", namespace), event)
