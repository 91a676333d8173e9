"""The scaling loop: one task per ModelServer that scrapes its ready pods, decides, scales and
writes the status every scrape interval; in scaling mode External (modes.py) it only keeps the
Deployment at spec.replicas.

Not a kopf timer: kopf puts a finalizer on every object that has a timer, and a finalizer makes
deleting a ModelServer wait for the operator. These tasks start when the watch first sees a
ModelServer and stop when it is gone; the owner references let the garbage collector remove the
Deployment, Service and PDB, with or without the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from . import modes, owned
from .bursts import Bursts
from .conditions import now_iso, set_condition
from .events import post_event
from .kube import ApiError, KubeApi, NotFound, api_path
from .metrics import OperatorMetrics
from .policy import Decision, MetricsWindow, ScalingState, ScalingTargets, burst_headroom, decide
from .resources import selector, selector_string
from .scrape import PodSample, Unreadable, metrics_url, scrape_pod
from .settings import OperatorSettings
from .spec import InvalidSpec, ModelServerSpec, parse_spec
from .window import MetricsHistory

log = logging.getLogger("tandem.operator.scaler")
# A window must hold at least this many scrapes of each pod: with one, there is no rate of
# tokens (so no cost) and no TTFT increase. Shorter windows are raised to it (SpecAdjusted).
MIN_WINDOW_SCRAPES = 2
# Decisions made without fresh metrics of every pod: ScalingActive is False for them.
NOT_SCALING = ("MetricsMissing", "MetricsStale", "PodsNotReady")


@dataclass
class Scaling:
    """What the loop remembers about one ModelServer between ticks."""

    history: MetricsHistory = field(default_factory=MetricsHistory)
    state: ScalingState | None = None
    warned: dict[str, str] = field(default_factory=dict)  # reason -> message of the last Warning
    # The ModelServer as the last status write answered: newer than the watch's copy can be, and
    # after any write of spec.replicas (the watch's copy may lag behind them by several events).
    latest: dict | None = None
    claimed: int | None = None  # spec.replicas as the operator last wrote or found it (mode Operator)
    started: set[str] = field(default_factory=set)  # pods whose start an Event has told


@dataclass
class Shared:
    """Operator-wide state, reachable from every object's memo (kopf copies memos shallowly)."""

    settings: OperatorSettings
    # with leader election: whether this replica holds the Lease now (its API writes ask it)
    leading: Callable[[], bool] | None = None
    api: KubeApi | None = None
    scrape_limit: asyncio.Semaphore | None = None
    http: aiohttp.ClientSession | None = None
    bodies: dict[str, dict] = field(default_factory=dict)  # uid -> newest ModelServer seen
    scaling: dict[str, Scaling] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)

    def api_client(self) -> KubeApi:
        """The API client, made by the login handler (kopf logs in before it watches anything)."""
        assert self.api is not None
        return self.api


def watch(shared: Shared, body: dict, deleted: bool) -> None:
    """Follow the watch: start a ModelServer's loop when it appears, stop it when it is gone."""
    uid = body["metadata"]["uid"]
    if deleted:
        shared.metrics.forget(body["metadata"].get("namespace") or "", body["metadata"].get("name") or "")
        shared.bodies.pop(uid, None)
        shared.scaling.pop(uid, None)
        task = shared.tasks.pop(uid, None)
        if task is not None:
            task.cancel()
        return
    shared.bodies[uid] = body
    if uid not in shared.tasks:
        shared.tasks[uid] = asyncio.create_task(_loop(shared, uid), name=f"scale {uid}")


async def stop_all(shared: Shared) -> None:
    tasks = list(shared.tasks.values())
    shared.tasks.clear()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _loop(shared: Shared, uid: str) -> None:
    interval = shared.settings.scrape_interval_s
    await asyncio.sleep(interval)  # the create handler goes first
    while uid in shared.bodies:
        started = time.monotonic()
        body = shared.bodies[uid]
        try:
            with shared.metrics.tick(modes.mode_of(body)):
                await tick(shared, body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one ModelServer's failure must not end its loop: next tick
            meta = body["metadata"]
            log.warning(f"{meta.get('namespace')}/{meta.get('name')}: scaling tick failed: {exc!r}")
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


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


async def event(api: KubeApi, body: dict, type_: str, reason: str, message: str) -> None:
    try:
        await post_event(api, body, type_, reason, message)
    except (ApiError, aiohttp.ClientError) as exc:  # an Event is worth a try, not a failed decision
        log.warning(f"could not post the {reason} Event: {exc}")


async def _write_status(api: KubeApi, body: dict, status: dict) -> dict | None:
    """The ModelServer as the API server has it after the write (None: deleted meanwhile)."""
    with contextlib.suppress(NotFound):  # deleted meanwhile
        return await api.patch(owned.ref(body).path + "/status", {"status": status})
    return None


def problem_conditions(body: dict, reason: str, message: str) -> list[dict]:
    """Ready and ScalingActive False for a problem only a person can fix (InvalidSpec, NotOwned)."""
    generation = body["metadata"].get("generation")
    conditions = (body.get("status") or {}).get("conditions")
    conditions = set_condition(conditions, "Ready", False, reason, message, generation)
    return set_condition(conditions, "ScalingActive", False, reason, message, generation)


async def warn_once(shared: Shared, body: dict, reason: str, message: str) -> None:
    """A Warning Event when a problem appears or changes, not on every tick it lasts."""
    scaling = shared.scaling.setdefault(body["metadata"]["uid"], Scaling())
    if scaling.warned.get(reason) != message:
        scaling.warned[reason] = message
        await event(shared.api_client(), body, "Warning", reason, message)


async def warn_problem(shared: Shared, body: dict, reason: str, message: str) -> list[dict]:
    """Warn of a problem only a person can fix (once); the conditions that say it, to be written."""
    await warn_once(shared, body, reason, message)
    return problem_conditions(body, reason, message)


async def ensure_owned(shared: Shared, body: dict, spec: ModelServerSpec) -> list[str]:
    """Make or update the ModelServer's Deployment, Service and PDB: what was done, one line each.
    Raises owned.NotOwned, having changed nothing, when any of them belongs to someone else."""
    name, namespace, uid = owned.ref(body)
    objects = owned.build(name, namespace, uid, spec, shared.settings.metrics_port)
    return await owned.ensure(shared.api_client(), name, namespace, uid, objects)


async def tick(shared: Shared, body: dict) -> Decision | None:
    """One round for one ModelServer: the Deployment's state, the pods' metrics, a decision."""
    api = shared.api_client()
    if body["metadata"].get("deletionTimestamp"):
        return None  # being deleted: the garbage collector takes its objects
    name, namespace, uid = owned.ref(body)
    try:
        spec = parse_spec(body.get("spec") or {})
    except InvalidSpec as exc:
        await _write_status(api, body, {"conditions": problem_conditions(body, "InvalidSpec", str(exc))})
        return None
    try:
        deployment = await api.get(api_path("apps/v1", "deployments", namespace, name))
        if not owned.controlled_by(deployment, uid):
            raise owned.NotOwned("Deployment", namespace, name, owned.controller_of(deployment))
    except NotFound:
        # not made yet, or refused before (a foreign Service, say): try again; it may be gone
        try:
            for what in await ensure_owned(shared, body, spec):
                log.info(f"{namespace}/{name}: {what}")
        except owned.NotOwned as exc:
            await _not_owned(shared, body, exc)
        return None
    except owned.NotOwned as exc:
        await _not_owned(shared, body, exc)
        return None
    if spec.scaling.mode == modes.EXTERNAL:
        await follow_spec(shared, body, spec, deployment)
        return None
    return await scale_once(shared, body, spec, deployment)


async def _not_owned(shared: Shared, body: dict, exc: owned.NotOwned) -> None:
    conditions = await warn_problem(shared, body, "NotOwned", str(exc))
    await _write_status(shared.api_client(), body, {"conditions": conditions})


async def scale_once(shared: Shared, body: dict, spec: ModelServerSpec, deployment: dict) -> Decision:
    """Scrape the ready pods, decide, scale, write the status."""
    api, settings = shared.api_client(), shared.settings
    assert shared.http is not None and shared.scrape_limit is not None
    name, namespace, uid = owned.ref(body)
    current = int((deployment.get("spec") or {}).get("replicas") or 0)
    pods = await api.list(api_path("v1", "pods", namespace), selector(name))
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
            )
            for p in ready
        )
    )
    samples = [s for s in scrapes if isinstance(s, PodSample)]
    unreadable = [s for s in scrapes if isinstance(s, Unreadable)]
    for bad in unreadable:
        log.warning(f"{namespace}/{name}: pod {bad.pod}: {bad.problem}")
        shared.metrics.scrape_failed(namespace, name, bad.kind)
    scaling = shared.scaling.setdefault(uid, Scaling())
    scaling.warned.pop("NotOwned", None)  # the objects are ours (again)
    window_s, clamped = metrics_window_s(spec, settings)
    if clamped:
        await warn_once(shared, body, "MetricsWindowClamped", clamped)
    scaling.history.add(now, samples, window_s)
    window = scaling.history.window(spec.price_per_gpu_hour * spec.gpus_per_pod)
    await tell_starts(api, body, scaling, samples, {p["metadata"]["name"] for p in pods})

    state = scaling.state or _first_state(modes.newest(scaling.latest, body), current, len(ready), now)
    state = replace(state, current_replicas=current, ready_replicas=len(ready))
    targets = spec.targets()
    decision = decide(window, targets, state, now, settings.stale_after_s)
    scaling.state = decision.state
    shared.metrics.decided(namespace, name, decision.action, decision.reason)
    _tell_bursts(shared, namespace, name, decision.state, targets, now)

    status: dict[str, Any] = {}
    if decision.action != "Hold":
        try:
            await api.patch(
                api_path("apps/v1", "deployments", namespace, name) + "/scale",
                {"spec": {"replicas": decision.replicas}},
            )
        except ApiError as exc:
            scaling.state = state  # not applied: decide again next tick
            log.warning(f"{namespace}/{name}: scaling to {decision.replicas} failed: {exc}")
            return decision
        reason = "ScaledUp" if decision.action == "ScaleUp" else "ScaledDown"
        message = f"{current} -> {decision.replicas} pods ({decision.reason}): {decision.message}"
        log.info(f"{namespace}/{name}: {message}")
        await event(api, body, "Normal", reason, message)
        status["lastScaleTime"] = now_iso(now)
    await claim_replicas(shared, body, current, decision.replicas)

    status.update(_observed(decision, current, len(ready), window, now))
    status["selector"] = selector_string(name)
    status["learnedBursts"] = decision.state.bursts.as_status()
    status["conditions"] = _conditions(body, spec, decision, current, len(ready), unreadable, clamped)
    scaling.latest = await _write_status(api, body, status)
    shared.metrics.observed(namespace, name, current, decision.replicas, len(ready))
    return decision


def _first_state(body: dict, current: int, ready: int, now: float) -> ScalingState:
    """The policy's state on its first decision for this ModelServer in this operator: fresh, but
    for what an earlier operator learned about bursts (status.learnedBursts)."""
    learned = Bursts.from_status((body.get("status") or {}).get("learnedBursts"), now)
    if learned.growth or learned.starts:
        name, namespace, _ = owned.ref(body)
        log.info(f"{namespace}/{name}: burst growth of {len(learned.growth)} hours and "
                 f"{len(learned.starts)} pod starts taken back from the status")
    return ScalingState(current, ready, bursts=learned)


def _tell_bursts(
    shared: Shared, namespace: str, name: str, state: ScalingState, targets: ScalingTargets, now: float
) -> None:
    """The operator's gauges of what the policy learned about bursts."""
    room = burst_headroom(state, targets, now) if targets.burst_headroom else None
    growth = room.growth if room is not None else state.bursts.factor(now)
    start = state.bursts.start_s(targets.pod_start_s)
    shared.metrics.learned(namespace, name, growth, room.pods if room is not None else 0, start)


async def tell_starts(api: KubeApi, body: dict, scaling: Scaling, samples: list[PodSample],
                      pods: set[str]) -> None:
    """A Normal `PodStarted` Event for each pod the first time its metrics say how its start went:
    seconds to SERVING and by phase (a new pod of a scale-up that reused a shared compile cache
    shows it in its compile phase)."""
    scaling.started &= pods  # forget pods that are gone: the set stays as small as the pod list
    for sample in samples:
        if sample.serving_after_s is None or sample.pod in scaling.started:
            continue
        scaling.started.add(sample.pod)
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in sample.startup_phases.items())
        message = f"pod {sample.pod} SERVING {sample.serving_after_s:.1f} s after its server started"
        await event(api, body, "Normal", "PodStarted", f"{message} ({phases})" if phases else message)


async def _write_spec_replicas(api: KubeApi, body: dict, replicas: int) -> bool:
    modelserver = owned.ref(body)
    try:
        await api.patch(modelserver.path, {"spec": {"replicas": replicas}})
    except NotFound:  # deleted meanwhile
        return False
    except ApiError as exc:  # the next tick tries again
        where = f"{modelserver.namespace}/{modelserver.name}"
        log.warning(f"{where}: could not write spec.replicas {replicas}: {exc}")
        return False
    return True


async def claim_replicas(shared: Shared, body: dict, current: int, running: int) -> None:
    """Scaling mode Operator: spec.replicas shows the pods the policy runs. A value someone else
    wrote there (kubectl scale, an HPA) is put back, with a Warning: two scalers would flap."""
    scaling = shared.scaling.setdefault(body["metadata"]["uid"], Scaling())
    written = modes.spec_replicas(modes.newest(scaling.latest, body))
    if written == running:
        scaling.claimed = running
        return
    if modes.overridden(written, current, scaling.claimed):
        message = (
            f"spec.replicas {written} was set by someone else and is put back to {running}: in scaling "
            "mode Operator the operator sets it; to scale with an HPA, KEDA or kubectl scale, set "
            "spec.scaling.mode to External"
        )
        await warn_once(shared, body, "ReplicasOverridden", message)
    if await _write_spec_replicas(shared.api_client(), body, running):
        scaling.claimed = running


async def follow_spec(shared: Shared, body: dict, spec: ModelServerSpec, deployment: dict) -> None:
    """Scaling mode External: the Deployment runs spec.replicas within the bounds, and nothing is
    scraped or decided. spec.replicas is written only while unset (the scale subresource needs it)."""
    api = shared.api_client()
    name, namespace, uid = owned.ref(body)
    current = int((deployment.get("spec") or {}).get("replicas") or 0)
    scaling = shared.scaling.setdefault(uid, Scaling())
    # Back in mode Operator the policy starts afresh, as after a restart (no scale-down before it
    # has seen a whole window), not from a window of scrapes made before the switch.
    scaling.history, scaling.state = MetricsHistory(), None
    fresh = modes.newest(scaling.latest, body)
    wanted = modes.spec_replicas(fresh)
    if wanted is None:
        wanted = spec.scaling.bounded(current)
        await _write_spec_replicas(api, body, wanted)
    target = spec.scaling.bounded(wanted)  # the bounds hold whoever scales
    now = time.time()
    if target != current:
        try:
            await api.patch(
                api_path("apps/v1", "deployments", namespace, name) + "/scale", {"spec": {"replicas": target}}
            )
        except ApiError as exc:
            log.warning(f"{namespace}/{name}: scaling to {target} failed: {exc}")
            return
        message = f"{current} -> {target} pods ({modes.EXTERNAL_SCALER}): spec.replicas {wanted}"
        log.info(f"{namespace}/{name}: {message}")
        await event(api, body, "Normal", "ScaledUp" if target > current else "ScaledDown", message)
    pods = await api.list(api_path("v1", "pods", namespace), selector(name))
    status = modes.external_status(
        fresh, spec, wanted, current, target, len([p for p in pods if _pod_ready(p)]), now
    )
    shared.metrics.decided(namespace, name, status["lastDecision"]["action"], modes.EXTERNAL_SCALER)
    scaling.latest = await _write_status(api, body, status)
    shared.metrics.observed(namespace, name, target, target, status["readyReplicas"])


def metrics_window_s(spec: ModelServerSpec, settings: OperatorSettings) -> tuple[float, str]:
    """The window to aggregate over, and why it is not the spec's (empty when it is): the CRD
    cannot know the operator's scrape interval, so the operator raises a shorter window."""
    asked = spec.scaling.metrics_window_seconds
    least = MIN_WINDOW_SCRAPES * settings.scrape_interval_s
    if asked >= least:
        return float(asked), ""
    return least, (
        f"metricsWindowSeconds {asked} holds fewer than {MIN_WINDOW_SCRAPES} scrapes at the operator's "
        f"scrape interval of {settings.scrape_interval_s:g} s: using {least:g} s"
    )


def _observed(decision: Decision, current: int, ready: int, window: MetricsWindow | None, now: float) -> dict:
    fields: dict[str, Any] = {
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
    return fields


def _conditions(
    body: dict,
    spec: ModelServerSpec,
    decision: Decision,
    current: int,
    ready: int,
    unreadable: list[Unreadable],
    clamped: str,
) -> list[dict]:
    generation = body["metadata"].get("generation")
    conditions = (body.get("status") or {}).get("conditions")
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
    # at the floor whatever the reason: pods that report their capacity hold there with
    # SpareCapacity, others with Underused, a busy floor with WithinTargets
    at_min = not at_max and decision.replicas <= spec.scaling.min_replicas
    bounds = f"bounds {spec.scaling.min_replicas}-{spec.scaling.max_replicas}"
    if decision.reason == "CostCeilingUnreachable":  # the SLO wins over the ceiling
        limited, why, message = True, "CostCeilingUnreachable", decision.message
    else:
        limited, message = at_max or at_min, bounds
        why = "AtMaximum" if at_max else ("AtMinimum" if at_min else "WithinBounds")
    conditions = set_condition(conditions, "ScalingLimited", limited, why, message, generation)
    if clamped:
        conditions = set_condition(
            conditions, "SpecAdjusted", True, "MetricsWindowClamped", clamped, generation
        )
    else:
        conditions = set_condition(
            conditions, "SpecAdjusted", False, "AsWritten", "the spec is used as written", generation
        )
    if unreadable:
        names = "; ".join(f"{u.pod}: {u.problem}" for u in sorted(unreadable, key=lambda u: u.pod))
        return set_condition(
            conditions, "MetricsAvailable", False, "PodsNotReporting", names[:1024], generation
        )
    message = "every ready pod's metrics were read"
    return set_condition(conditions, "MetricsAvailable", True, "AllPodsReporting", message, generation)
