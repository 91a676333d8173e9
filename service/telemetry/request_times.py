"""When the engine front saw a request's milestones: the request spans' children come from these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestTimes:
    """Wall clock (time.time() seconds); None = not reached (yet)."""

    arrival: float  # the front accepted the request and queued it for the engine
    scheduled: float | None = None  # the first engine step that computed any of its prompt began
    first_token: float | None = None  # the front received its first generated token
    last_token: float | None = None  # ... and its last one so far
