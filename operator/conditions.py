"""Status conditions in the Kubernetes convention (type, status, reason, message, lastTransitionTime)."""

from __future__ import annotations

import datetime


def now_iso(ts: float | None = None) -> str:
    when = (
        datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
        if ts
        else datetime.datetime.now(datetime.timezone.utc)
    )
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def from_iso(value: object) -> float | None:
    """An RFC 3339 time with a zone (as now_iso writes it) in seconds since the epoch; None if it is
    not one."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def set_condition(
    conditions: list[dict] | None,
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int | None = None,
) -> list[dict]:
    """The list with `type_` set; its transition time moves only when its status changes."""
    value = "Unknown" if status is None else ("True" if status else "False")
    result = [dict(c) for c in conditions or [] if c.get("type") != type_]
    old = next((c for c in conditions or [] if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == value else now_iso()
    new = {"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        new["observedGeneration"] = generation
    result.append(new)
    return sorted(result, key=lambda c: c["type"])
