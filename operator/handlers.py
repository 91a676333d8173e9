"""kopf handlers: ModelServer -> Deployment, Service, PodDisruptionBudget, and the watch that
starts and stops each ModelServer's scaling loop (scaler.py).

No handler needs a finalizer: there is no deletion handler (owner references let the garbage
collector remove the owned objects) and no kopf timer or daemon (kopf adds a finalizer for
those), so deleting a ModelServer never waits for the operator. The finalizer that earlier
versions added (`tandem.dev/operator`) is removed from every ModelServer the watch shows.

The handlers are declared on `registry`, which main.py runs kopf on; each run (the CLI's, or one
of a test's several) has its own memo, `Shared`, where the handlers keep what they share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import kopf

from . import owned, scaler
from .conditions import set_condition
from .kube import ApiError, KubeApi, NotFound
from .resources import selector_string
from .scaler import Shared
from .settings import OperatorSettings
from .spec import InvalidSpec, parse_spec

GROUP, VERSION, PLURAL = owned.GROUP, owned.VERSION, owned.PLURAL
ANNOTATION_PREFIX = "tandem.dev"
# The finalizer of earlier versions (kopf's, under this name): removed where it is found.
LEGACY_FINALIZER = f"{ANNOTATION_PREFIX}/operator"
# The operator's handlers, and no one else's: kopf's default registry would also take any other
# handlers declared in the process, and login fallbacks of whichever Kubernetes client is installed.
registry = kopf.OperatorRegistry()

__all__ = ["Shared", "connection_info", "registry"]


def connection_info(ours: OperatorSettings, /, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """The API server and credentials: the settings' URL, the service account, or kubeconfig
    (kwargs: what kopf passes to a login handler, its logger at least)."""
    if ours.api_server:
        return kopf.ConnectionInfo(server=ours.api_server, insecure=True)
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


async def remove_legacy_finalizer(api: KubeApi, body: dict, logger: logging.Logger | kopf.Logger) -> None:
    """Take the earlier versions' finalizer off, by index and only if it is still at that index (a
    JSON-patch test): other controllers' finalizers stay, whatever they did meanwhile."""
    finalizers = body["metadata"].get("finalizers") or []
    if LEGACY_FINALIZER not in finalizers:
        return
    at = f"/metadata/finalizers/{finalizers.index(LEGACY_FINALIZER)}"
    try:
        await api.json_patch(
            owned.ref(body).path,
            [{"op": "test", "path": at, "value": LEGACY_FINALIZER}, {"op": "remove", "path": at}],
        )
        logger.info(f"removed the finalizer {LEGACY_FINALIZER} of earlier operator versions")
    except (NotFound, ApiError) as exc:  # gone, or changed meanwhile: the next event says
        logger.debug(f"finalizer {LEGACY_FINALIZER} not removed this time: {exc}")


def _shared(memo: kopf.Memo) -> Shared:
    return memo.shared


@kopf.on.startup(registry=registry)
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Kubernetes Events: one per scaling decision (ours); kopf's own only for warnings.
    settings.posting.level = logging.WARNING
    # Progress in annotations, not status.kopf: the CRD's status schema has no such field.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    shared = _shared(memo)
    shared.scrape_limit = asyncio.Semaphore(shared.settings.scrape_concurrency)
    shared.http = aiohttp.ClientSession(trust_env=False)


@kopf.on.login(registry=registry)
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    shared = _shared(memo)
    info = connection_info(shared.settings, **kwargs)
    if info is not None:
        if shared.api is not None:  # a re-login (e.g. an expired token): its session goes
            await shared.api.close()
        shared.api = KubeApi(info, may_write=shared.leading)
    return info


@kopf.on.cleanup(registry=registry)
async def close(memo: kopf.Memo, **_: Any) -> None:
    shared = _shared(memo)
    await scaler.stop_all(shared)
    for session in (shared.http, shared.api):
        if session is not None:
            await session.close()


@kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
async def follow(
    body: kopf.Body,
    type: str | None,  # noqa: A002
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    shared = _shared(memo)
    await remove_legacy_finalizer(shared.api_client(), dict(body), logger)
    scaler.watch(shared, dict(body), deleted=type == "DELETED")


@kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
async def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: kopf.Logger,
    diff: kopf.Diff = (),
    reason: str | None = None,  # create, update or resume
    **_: Any,
) -> None:
    shared = _shared(memo)
    started, result = time.monotonic(), "Error"  # an exception: kopf retries
    try:
        if reason == "update" and diff and all(tuple(d.field) == ("spec", "replicas") for d in diff):
            # A scale (the policy's own, an HPA's, kubectl scale's): the owned objects hold no
            # replicas, so nothing is to be made or updated; the generation is seen all the same.
            patch.status["observedGeneration"] = body.metadata.get("generation")
            result = "Reconciled"
            return
        result = await _reconcile(shared, dict(body), spec, patch, logger)
    finally:
        shared.metrics.reconciled(result, time.monotonic() - started)


async def _reconcile(
    shared: Shared, body: dict, spec: kopf.Spec, patch: kopf.Patch, logger: kopf.Logger
) -> str:
    """Make or update the owned objects; the status says what stands in the way. Returns what came
    of it: Reconciled, InvalidSpec or NotOwned."""
    generation = body["metadata"].get("generation")
    # the scale subresource's selector, for an HPA, before the first scaling tick
    patch.status["selector"] = selector_string(owned.ref(body).name)
    try:
        for what in await scaler.ensure_owned(shared, body, parse_spec(spec)):
            logger.info(what)
    except (InvalidSpec, owned.NotOwned) as exc:
        # Not raised: kopf would retry what only a person can fix.
        reason = "InvalidSpec" if isinstance(exc, InvalidSpec) else "NotOwned"
        logger.error(f"{reason}: {exc}")
        patch.status["conditions"] = await scaler.warn_problem(shared, body, reason, str(exc))
        return reason
    old = (body.get("status") or {}).get("conditions")
    conditions = old
    # A problem no longer holds; the scaling loop sets Ready and ScalingActive from what it sees.
    for type_ in ("Ready", "ScalingActive"):
        found = next((c for c in conditions or [] if c.get("type") == type_), None)
        if found is None or found.get("reason") in ("InvalidSpec", "NotOwned"):
            conditions = set_condition(conditions, type_, None, "Reconciled", "waiting for pods", generation)
    if conditions != old:  # else left alone: this event's copy may be older than the loop's last write
        patch.status["conditions"] = conditions
    patch.status["observedGeneration"] = generation
    return "Reconciled"
