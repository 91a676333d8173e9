"""The objects a ModelServer owns, made and kept in shape, and never taken over from anyone else.

An object of the ModelServer's name that is not controlled by it (its ownerReferences hold no
controller reference with the ModelServer's uid) may belong to another workload: the operator
neither patches nor deletes it, and changes none of the ModelServer's objects while it is there
(`NotOwned`). Whoever may create ModelServers can therefore not rewrite other workloads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from . import resources
from .kube import ApiError, KubeApi, NotFound, api_path
from .spec import ModelServerSpec

GROUP, VERSION, KIND, PLURAL = "tandem.dev", "v1alpha1", "ModelServer", "modelservers"


class ModelServerRef(NamedTuple):
    """Which ModelServer (unpacks as name, namespace, uid), and where the API serves it."""

    name: str
    namespace: str
    uid: str

    @property
    def path(self) -> str:
        return api_path(f"{GROUP}/{VERSION}", PLURAL, self.namespace, self.name)


def ref(body: Mapping) -> ModelServerRef:
    meta = body["metadata"]
    return ModelServerRef(meta["name"], meta["namespace"], meta["uid"])


def owner_reference(name: str, uid: str) -> dict:
    # No blockOwnerDeletion: it only matters to foreground deletion, and setting it needs
    # update on modelservers/finalizers where the API server enforces owner-reference permissions.
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid, "controller": True}


def controller_of(obj: dict) -> dict | None:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def controlled_by(obj: dict, uid: str) -> bool:
    controller = controller_of(obj)
    return controller is not None and controller.get("uid") == uid


class NotOwned(Exception):
    """An object of the ModelServer's name exists and belongs to someone else (or to no one)."""

    def __init__(self, kind: str, namespace: str, name: str, controller: dict | None) -> None:
        owner = f"{controller.get('kind')} {controller.get('name')}" if controller else "no controller"
        super().__init__(
            f"{kind} {namespace}/{name} exists and is not controlled by this ModelServer ({owner}); "
            "the operator leaves it alone: remove it, or give the ModelServer another name"
        )


@dataclass(frozen=True)
class Owned:
    api_version: str
    plural: str
    body: dict

    @property
    def kind(self) -> str:
        return self.body["kind"]

    def path(self, namespace: str, name: str | None = None) -> str:
        return api_path(self.api_version, self.plural, namespace, name)


def build(name: str, namespace: str, uid: str, spec: ModelServerSpec, metrics_port: int) -> list[Owned]:
    objects = [
        Owned("apps/v1", "deployments", resources.deployment(name, spec, metrics_port)),
        Owned("v1", "services", resources.service(name, spec, metrics_port)),
        Owned("policy/v1", "poddisruptionbudgets", resources.pod_disruption_budget(name)),
    ]
    for obj in objects:
        obj.body["metadata"]["namespace"] = namespace
        obj.body["metadata"]["ownerReferences"] = [owner_reference(name, uid)]
    return objects


async def _existing(api: KubeApi, obj: Owned, namespace: str, name: str, uid: str) -> dict | None:
    try:
        found = await api.get(obj.path(namespace, name))
    except NotFound:
        return None
    if not controlled_by(found, uid):
        raise NotOwned(obj.kind, namespace, name, controller_of(found))
    return found


async def ensure(api: KubeApi, name: str, namespace: str, uid: str, objects: list[Owned]) -> list[str]:
    """Create the missing objects and bring the others to shape (never replicas), or raise
    NotOwned, having changed nothing, if any of them belongs to someone else."""
    found = [await _existing(api, obj, namespace, name, uid) for obj in objects]
    done = []
    for obj, existing in zip(objects, found, strict=True):
        if existing is None:
            try:
                await api.create(obj.path(namespace), obj.body)
                done.append(f"{obj.kind} {name} created")
                continue
            except ApiError as exc:
                if exc.status != 409:  # 409: made meanwhile (by us, or by someone else: look)
                    raise
            await _existing(api, obj, namespace, name, uid)
        spec = {k: v for k, v in obj.body["spec"].items() if k not in ("replicas", "selector")}
        await api.patch(
            obj.path(namespace, name), {"metadata": {"labels": obj.body["metadata"]["labels"]}, "spec": spec}
        )
        done.append(f"{obj.kind} {name} updated")
    return done
