"""Who sets a ModelServer's replicas (spec.scaling.mode), and what spec.replicas, the field behind
its scale subresource, means in each mode. Pure functions: scaler.py does the API calls.

- Operator (the default): the built-in policy decides. Each decision is written to spec.replicas,
  so `kubectl get --subresource=scale` and an HPA's view agree with what runs, and a value someone
  else writes there is put back (with a Warning Event), as an HPA puts back a `kubectl scale` of
  its Deployment: two scalers on one object would flap it.
- External: an HPA, a KEDA ScaledObject or `kubectl scale` writes spec.replicas; the operator keeps
  the Deployment at it within minReplicas-maxReplicas, scrapes no pod and decides nothing.
"""

from __future__ import annotations

from .conditions import now_iso, set_condition
from .resources import selector_string
from .spec import ModelServerSpec

OPERATOR, EXTERNAL = "Operator", "External"
EXTERNAL_SCALER = "ExternalScaler"  # the reason of every External-mode condition and decision
# Status fields External mode keeps; the others are observations of scrapes, which it does not make.
EXTERNAL_STATUS = frozenset(
    {
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "desiredReplicas",
        "selector",
        "lastScaleTime",
        "lastDecision",
        "conditions",
    }
)


def mode_of(body: dict) -> str:
    """The scaling mode as written, for a metric label before the spec is parsed (Operator unless
    it says External: never an arbitrary string)."""
    scaling = (body.get("spec") or {}).get("scaling")
    return EXTERNAL if isinstance(scaling, dict) and scaling.get("mode") == EXTERNAL else OPERATOR


def newest(latest: dict | None, body: dict) -> dict:
    """Of the ModelServer as the last status write answered and as the watch shows it, the one with
    the newer spec: metadata.generation grows with every spec change; on a tie the status write's,
    which came after the operator's own writes (the watch may lag behind them by several events)."""

    def generation(obj: dict) -> int:
        value = (obj.get("metadata") or {}).get("generation")
        return value if isinstance(value, int) else 0

    return body if latest is None or generation(body) > generation(latest) else latest


def spec_replicas(body: dict) -> int | None:
    value = (body.get("spec") or {}).get("replicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def overridden(written: int | None, running: int, claimed: int | None) -> bool:
    """In mode Operator: whether someone else wrote spec.replicas. It is set, differs from the pods
    that ran, and is not the operator's own last value (which stays when the Deployment itself
    was scaled by hand: the policy goes on from there)."""
    return written is not None and written != running and written != claimed


def stale_observations(status: dict) -> dict:
    """Merge-patch nulls for the status fields of scrapes, which External mode does not make."""
    return {key: None for key in status if key not in EXTERNAL_STATUS}


def external_conditions(
    body: dict, spec: ModelServerSpec, wanted: int, target: int, ready: int
) -> list[dict]:
    generation = body["metadata"].get("generation")
    conditions = [
        c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") != "SpecAdjusted"
    ]
    pods_ready = target > 0 and ready >= target
    conditions = set_condition(
        conditions,
        "Ready",
        pods_ready,
        "AllPodsReady" if pods_ready else "PodsNotReady",
        f"{ready} of {target} pods ready",
        generation,
    )
    active = (
        f"scaling mode External: the pods follow spec.replicas ({wanted}), which an HPA, KEDA or "
        "kubectl scale sets; the operator reads no pod metrics and makes no decision"
    )
    conditions = set_condition(conditions, "ScalingActive", False, EXTERNAL_SCALER, active, generation)
    s = spec.scaling
    if wanted > s.max_replicas or wanted < s.min_replicas:
        above = wanted > s.max_replicas
        why = "AtMaximum" if above else "AtMinimum"
        bound = f"maxReplicas {s.max_replicas}" if above else f"minReplicas {s.min_replicas}"
        message = f"spec.replicas {wanted} is {'above' if above else 'below'} {bound}: running {target}"
        conditions = set_condition(conditions, "ScalingLimited", True, why, message, generation)
    else:
        bounds = f"bounds {s.min_replicas}-{s.max_replicas}"
        conditions = set_condition(conditions, "ScalingLimited", False, "WithinBounds", bounds, generation)
    unread = "scaling mode External: no pod's /metrics is read"
    return set_condition(conditions, "MetricsAvailable", None, EXTERNAL_SCALER, unread, generation)


def external_status(
    body: dict, spec: ModelServerSpec, wanted: int, current: int, target: int, ready: int, now: float
) -> dict:
    """The status of an External-mode tick that moved the Deployment from `current` to `target` pods
    for spec.replicas `wanted`: the scale subresource's fields, the move as lastDecision, and no
    observations of scrapes (nulls remove those left from mode Operator)."""
    action = "ScaleUp" if target > current else ("ScaleDown" if target < current else "Hold")
    s = spec.scaling
    status = stale_observations(body.get("status") or {})
    status.update(
        {
            "replicas": target,
            "readyReplicas": ready,
            "desiredReplicas": target,
            "selector": selector_string(body["metadata"]["name"]),
            "lastDecision": {
                "action": action,
                "fromReplicas": current,
                "toReplicas": target,
                "reason": EXTERNAL_SCALER,
                "message": f"spec.replicas {wanted} (bounds {s.min_replicas}-{s.max_replicas})",
                "time": now_iso(now),
            },
            "conditions": external_conditions(body, spec, wanted, target, ready),
        }
    )
    if action != "Hold":
        status["lastScaleTime"] = now_iso(now)
    return status
