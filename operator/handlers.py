"""kopf handlers: ModelServer -> Deployment, Service, PodDisruptionBudget; a timer that scales.

`register()` adds them to a registry with the operator's settings, so that tests and the CLI
each build their own operator.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import kopf

from . import resources
from .conditions import now_iso, set_condition
from .events import post_event
from .kube import ApiError, KubeApi, NotFound, api_path
from .policy import Decision, ScalingState, decide
from .scrape import PodSample, Unreadable, metrics_url, scrape_pod
from .settings import OperatorSettings
from .spec import InvalidSpec, ModelServerSpec, parse_spec
from .window import MetricsHistory

GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "modelservers"
ANNOTATION_PREFIX = "tandem.dev"
NOT_SCALING = ("MetricsMissing", "MetricsStale", "PodsNotReady")

# (apiVersion, plural, builder) of every object a ModelServer owns
OWNED = (("apps/v1", "deployments"), ("v1", "services"), ("policy/v1", "poddisruptionbudgets"))


@dataclass
class Shared:
    """Operator-wide state, reachable from every object's memo (kopf copies memos shallowly)."""

    settings: OperatorSettings
    api: KubeApi | None = None
    scrape_limit: asyncio.Semaphore | None = None
    http: aiohttp.ClientSession | None = None
    per_object: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scaling:
    """What the timer remembers about one ModelServer between ticks."""

    history: MetricsHistory = field(default_factory=MetricsHistory)
    state: ScalingState | None = None


def _owned_objects(name: str, spec: ModelServerSpec, metrics_port: int) -> list[tuple[str, str, dict]]:
    return [
        ("apps/v1", "deployments", resources.deployment(name, spec, metrics_port)),
        ("v1", "services", resources.service(name, spec, metrics_port)),
        ("policy/v1", "poddisruptionbudgets", resources.pod_disruption_budget(name)),
    ]


async def _ensure(api: KubeApi, api_version: str, plural: str, namespace: str, obj: dict) -> str:
    """Create the object, or bring an existing one to this shape (never touching replicas)."""
    name = obj["metadata"]["name"]
    try:
        await api.get(api_path(api_version, plural, namespace, name))
    except NotFound:
        await api.create(api_path(api_version, plural, namespace), obj)
        return "created"
    update = {
        "metadata": {
            "labels": obj["metadata"]["labels"],
            "ownerReferences": obj["metadata"]["ownerReferences"],
        },
        "spec": {k: v for k, v in obj["spec"].items() if k not in ("replicas", "selector")},
    }
    await api.patch(api_path(api_version, plural, namespace, name), update)
    return "updated"


def _invalid(patch: kopf.Patch, status: dict, body: kopf.Body, message: str) -> None:
    generation = body.metadata.get("generation")
    conditions = set_condition(status.get("conditions"), "Ready", False, "InvalidSpec", message, generation)
    conditions = set_condition(conditions, "ScalingActive", False, "InvalidSpec", message, generation)
    patch.status["conditions"] = conditions


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    on = {"registry": registry}

    @kopf.on.startup(**on)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Kubernetes Events: one per scaling decision (ours); kopf's own only for warnings.
        settings.posting.level = logging.WARNING
        # Progress in annotations, not status.kopf: the CRD's status schema has no such field.
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        shared: Shared = memo.shared
        shared.scrape_limit = asyncio.Semaphore(shared.settings.scrape_concurrency)
        shared.http = aiohttp.ClientSession(trust_env=False)

    @kopf.on.login(**on)
    async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
        shared: Shared = memo.shared
        if shared.settings.api_server:
            info = kopf.ConnectionInfo(server=shared.settings.api_server, insecure=True)
        else:
            info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            if shared.api is not None:  # a re-login (e.g. an expired token): its session goes
                await shared.api.close()
            shared.api = KubeApi(info)
        return info

    @kopf.on.cleanup(**on)
    async def close(memo: kopf.Memo, **_: Any) -> None:
        shared: Shared = memo.shared
        for session in (shared.http, shared.api):
            if session is not None:
                await session.close()

    @kopf.on.create(GROUP, VERSION, PLURAL, **on)
    @kopf.on.update(GROUP, VERSION, PLURAL, **on)
    @kopf.on.resume(GROUP, VERSION, PLURAL, **on)
    async def reconcile(
        body: kopf.Body,
        spec: kopf.Spec,
        status: kopf.Status,
        name: str,
        namespace: str,
        patch: kopf.Patch,
        memo: kopf.Memo,
        logger: kopf.Logger,
        **_: Any,
    ) -> None:
        try:
            parsed = parse_spec(spec)
        except InvalidSpec as exc:
            # Not raised: kopf would retry a spec that only a person can fix.
            logger.error(f"invalid spec: {exc}")
            shared: Shared = memo.shared
            assert shared.api is not None
            await _event(shared.api, body, "Warning", "InvalidSpec", str(exc), logger)
            _invalid(patch, dict(status), body, str(exc))
            return
        shared = memo.shared
        assert shared.api is not None
        for api_version, plural, obj in _owned_objects(name, parsed, shared.settings.metrics_port):
            obj["metadata"]["namespace"] = namespace
            kopf.append_owner_reference(obj, owner=body)
            what = await _ensure(shared.api, api_version, plural, namespace, obj)
            logger.info(f"{obj['kind']} {name} {what}")
        generation = body.metadata.get("generation")
        conditions = status.get("conditions")
        # InvalidSpec no longer holds; the timer sets Ready and ScalingActive from what it sees.
        for type_ in ("Ready", "ScalingActive"):
            old = next((c for c in conditions or [] if c.get("type") == type_), None)
            if old is None or old.get("reason") == "InvalidSpec":
                conditions = set_condition(
                    conditions, type_, None, "Reconciled", "waiting for pods", generation
                )
        patch.status["conditions"] = conditions
        patch.status["observedGeneration"] = generation

    @kopf.on.delete(GROUP, VERSION, PLURAL, **on)
    async def remove(
        name: str, namespace: str, uid: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
    ) -> None:
        shared: Shared = memo.shared
        assert shared.api is not None
        # The owner references would let the garbage collector do this; doing it here means the
        # objects are gone when the ModelServer is, on any cluster.
        for api_version, plural in OWNED:
            await shared.api.delete(api_path(api_version, plural, namespace, name))
        shared.per_object.pop(uid, None)
        logger.info(f"deleted the Deployment, Service and PodDisruptionBudget of {name}")

    @kopf.timer(GROUP, VERSION, PLURAL, interval=settings.scrape_interval_s, **on)
    async def autoscale(
        body: kopf.Body,
        spec: kopf.Spec,
        status: kopf.Status,
        name: str,
        namespace: str,
        uid: str,
        patch: kopf.Patch,
        memo: kopf.Memo,
        logger: kopf.Logger,
        **_: Any,
    ) -> None:
        try:
            parsed = parse_spec(spec)
        except InvalidSpec as exc:
            _invalid(patch, dict(status), body, str(exc))
            return
        shared: Shared = memo.shared
        await scale_once(shared, body, parsed, dict(status), name, namespace, uid, patch, logger)


async def _event(
    api: KubeApi, body: kopf.Body, type_: str, reason: str, message: str, logger: kopf.Logger
) -> None:
    try:
        await post_event(api, dict(body), type_, reason, message)
    except (ApiError, aiohttp.ClientError) as exc:  # an Event is worth a try, not a failed decision
        logger.warning(f"could not post the {reason} Event: {exc}")


def _pod_ready(pod: dict) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return (
        ready
        and status.get("phase") == "Running"
        and bool(status.get("podIP"))
        and not meta.get("deletionTimestamp")
    )


async def scale_once(
    shared: Shared,
    body: kopf.Body,
    spec: ModelServerSpec,
    status: dict,
    name: str,
    namespace: str,
    uid: str,
    patch: kopf.Patch,
    logger: kopf.Logger,
) -> Decision | None:
    """One tick: scrape the ready pods, decide, scale, write the status."""
    api, settings = shared.api, shared.settings
    assert api is not None and shared.http is not None and shared.scrape_limit is not None
    try:
        deployment = await api.get(api_path("apps/v1", "deployments", namespace, name))
    except NotFound:
        return None  # the create handler has not made it yet
    current = int((deployment.get("spec") or {}).get("replicas") or 0)
    pods = await api.list(api_path("v1", "pods", namespace), resources.selector(name))
    ready = [p for p in pods if _pod_ready(p)]

    now = time.time()
    scrapes = await asyncio.gather(
        *(
            scrape_pod(
                shared.http,
                shared.scrape_limit,
                p["metadata"]["name"],
                metrics_url(p["status"]["podIP"], settings.metrics_port),
                settings.scrape_timeout_s,
                now,
            )
            for p in ready
        )
    )
    samples = [s for s in scrapes if isinstance(s, PodSample)]
    unreadable = [s for s in scrapes if isinstance(s, Unreadable)]
    for bad in unreadable:
        logger.warning(f"pod {bad.pod}: {bad.problem}")
    scaling: Scaling = shared.per_object.setdefault(uid, Scaling())
    scaling.history.add(now, samples, spec.scaling.metrics_window_seconds)
    window = scaling.history.window(spec.price_per_gpu_hour * spec.gpus_per_pod)

    state = scaling.state or ScalingState(current, len(ready))
    state = replace(state, current_replicas=current, ready_replicas=len(ready))
    decision = decide(window, spec.targets(), state, now, settings.stale_after_s)
    scaling.state = decision.state

    if decision.action != "Hold":
        try:
            await api.patch(
                api_path("apps/v1", "deployments", namespace, name) + "/scale",
                {"spec": {"replicas": decision.replicas}},
            )
        except ApiError as exc:
            scaling.state = state  # not applied: decide again next tick
            raise kopf.TemporaryError(f"scaling to {decision.replicas} failed: {exc}", delay=5) from exc
        event = "ScaledUp" if decision.action == "ScaleUp" else "ScaledDown"
        message = f"{current} -> {decision.replicas} pods ({decision.reason}): {decision.message}"
        logger.info(message)
        await _event(api, body, "Normal", event, message, logger)
        patch.status["lastScaleTime"] = now_iso(now)

    _write_status(patch, status, body, spec, decision, current, len(ready), window, now)
    patch.status["conditions"] = _metrics_condition(patch.status["conditions"], unreadable, body)
    return decision


def _metrics_condition(conditions: list[dict], unreadable: list[Unreadable], body: kopf.Body) -> list[dict]:
    """MetricsAvailable names every ready pod whose /metrics could not be used this round."""
    if not unreadable:
        return set_condition(
            conditions, "MetricsAvailable", True, "AllPodsReporting", "every ready pod's metrics were read",
            body.metadata.get("generation"),
        )  # fmt: skip
    names = "; ".join(f"{u.pod}: {u.problem}" for u in sorted(unreadable, key=lambda u: u.pod))
    return set_condition(
        conditions,
        "MetricsAvailable",
        False,
        "PodsNotReporting",
        names[:1024],
        body.metadata.get("generation"),
    )


def _write_status(
    patch: kopf.Patch,
    status: dict,
    body: kopf.Body,
    spec: ModelServerSpec,
    decision: Decision,
    current: int,
    ready: int,
    window: Any,
    now: float,
) -> None:
    generation = body.metadata.get("generation")
    fields = {
        "replicas": current,
        "readyReplicas": ready,
        "desiredReplicas": decision.replicas,
        "lastDecision": {
            "action": decision.action,
            "fromReplicas": current,
            "toReplicas": decision.replicas,
            "reason": decision.reason,
            "message": decision.message,
            "time": now_iso(now),
        },
    }
    if window is not None:
        observed = {
            "idleFraction": window.idle_fraction,
            "costPerMillionTokensUsd": window.cost_per_mtok_usd,
            "tokensPerSecond": window.tokens_per_s,
            "requestsRunning": window.requests_running,
            "requestsWaiting": window.requests_waiting,
            "kvCacheUsage": window.kv_cache_usage,
            "timeToFirstTokenP95Seconds": window.ttft_p95_s,
        }
        # JSON has no Infinity or NaN: a value a pod's numbers overflowed to is left out
        fields.update({k: round(v, 4) for k, v in observed.items() if v is not None and math.isfinite(v)})
    for key, value in fields.items():
        patch.status[key] = value

    conditions = status.get("conditions")
    pods_ready = current > 0 and ready >= current
    conditions = set_condition(
        conditions,
        "Ready",
        pods_ready,
        "AllPodsReady" if pods_ready else "PodsNotReady",
        f"{ready} of {current} pods ready",
        generation,
    )
    active = decision.reason not in NOT_SCALING
    conditions = set_condition(
        conditions, "ScalingActive", active, decision.reason, decision.message, generation
    )
    at_max = decision.reason == "Saturated" and decision.replicas >= spec.scaling.max_replicas
    at_min = (
        decision.reason in ("Underused", "CostAboveCeiling")
        and decision.replicas <= spec.scaling.min_replicas
    )
    limited = at_max or at_min
    conditions = set_condition(
        conditions,
        "ScalingLimited",
        limited,
        "AtMaximum" if at_max else ("AtMinimum" if at_min else "WithinBounds"),
        f"bounds {spec.scaling.min_replicas}-{spec.scaling.max_replicas}",
        generation,
    )
    patch.status["conditions"] = conditions
