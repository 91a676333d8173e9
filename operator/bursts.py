"""What the policy learns about bursts: how long a new pod takes to serve, from its own scale-ups,
and how much the load grows within that time, from the load it has seen.

Pure and bounded: `Bursts` is an immutable value the policy keeps in its state (policy.py), one
load sample per decision, at most a few hundred numbers. The load is counted in pods' worth of
capacity (policy.load_in_pods), so its growth is a growth in pods.

What took a day to learn outlives the operator: the hourly growth and the measured starts go into
the ModelServer's `status.learnedBursts` (`as_status`), and an operator that starts (a restart, a
new leader) takes them back from there (`from_status`). The load samples are not kept: an hour of
them, relearned in the first minutes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Any

from .conditions import from_iso, now_iso

# The growth learned: the highest load(t) / load(t - start) of each hour, and of those of the last
# day this quantile: the growth exceeded in at most 2 hours of 24 (nearest rank). An unabsorbed
# burst costs about 5 minutes over the TTFT target, so the bursts left out fit in the 1% of minutes
# an SLO of 99% allows; hourly maxima count bursts, not seconds (a burst's onset is a minute or two
# of an hour), and a day holds enough bursts to learn from while forgetting a calm day's.
GROWTH_QUANTILE = 0.9
GROWTH_BLOCK_S = 3600.0
GROWTH_BLOCKS = 24
# Growth applies to the lower of the load now and its median over this long: within a burst it
# counts from the load before the burst, not from the burst's peak (bursts rarely stack).
REFERENCE_S = 3600.0
# At most this many load samples (1 h at the operator's default 15 s interval): a shorter scrape
# interval shortens the reference window instead of growing the memory.
MAX_LOAD_SAMPLES = 240
# Growth from less than half a pod's capacity counts from half a pod: traffic waking a quiet
# ModelServer is not a burst of 100x.
MIN_LOAD_PODS = 0.5
# Measured starts kept; the slowest of them is the start the headroom must bridge.
START_SAMPLES = 4
# A scale-up whose pods are not all ready after this long measured nothing (they failed, or
# were taken back); at most MAX_PENDING scale-ups wait for their pods at once.
MAX_START_S = 1800.0
MAX_PENDING = 4
# A load sample pairs with the one `start` before it, found within this many seconds.
PAIR_SLACK_S = 30.0


@dataclass(frozen=True)
class Bursts:
    # (time, load in pods' worth of capacity), oldest first: the last REFERENCE_S
    loads: tuple[tuple[float, float], ...] = ()
    # (hour began, highest load over the load one start before), oldest first: the last day
    growth: tuple[tuple[float, float], ...] = ()
    starts: tuple[float, ...] = ()  # seconds from a scale-up to its pods ready, newest last
    pending: tuple[tuple[float, int], ...] = ()  # scale-ups waiting for their pods: (time, replicas)

    def start_s(self, default: float) -> float:
        """The start to bridge: the slowest of the last measured, else `default`."""
        return min(max(self.starts) if self.starts else default, MAX_START_S)

    def ready(self, now: float, ready: int) -> Bursts:
        """Measure the scale-ups whose pods are all ready now."""
        if not self.pending:
            return self
        done = tuple(now - t for t, n in self.pending if ready >= n)
        waiting = tuple((t, n) for t, n in self.pending if ready < n and now - t <= MAX_START_S)
        if not done and waiting == self.pending:
            return self
        return replace(self, starts=(self.starts + done)[-START_SAMPLES:], pending=waiting)

    def scaled(self, now: float, before: int, after: int) -> Bursts:
        """Note a scale-up, to measure its start; a scale-down forgets those it undid."""
        if after > before:
            return replace(self, pending=(*self.pending, (now, after))[-MAX_PENDING:])
        if after < before:
            return replace(self, pending=tuple((t, n) for t, n in self.pending if n <= after))
        return self

    def observed(self, now: float, load: float, start_s: float) -> Bursts:
        """Add a load sample, and its growth within one start, when there are samples to pair.
        A growth counts once two samples in a row show it: one scrape is noise, not a burst (a pod
        just ready, a second's worth of fluctuation). The older of the two is paired with the load
        one start before it, so that the growth is measured over the whole start: paired from
        this sample, a start of one scrape interval would never show a growth."""
        if self.loads and now <= self.loads[-1][0]:
            return self  # time must move on (a repeated call, a clock step back)
        growth = self.growth
        if self.loads and self.loads[-1][0] >= now - PAIR_SLACK_S:
            previous_at, previous = self.loads[-1]
            then = self._around(previous_at - start_s)
            if then is not None:
                sustained = max(min(load, previous), MIN_LOAD_PODS)
                growth = _highest(growth, now, sustained / max(then, MIN_LOAD_PODS))
        keep = bisect.bisect_left(self.loads, now - REFERENCE_S, key=lambda s: s[0])
        loads = (*self.loads[keep:], (now, load))[-MAX_LOAD_SAMPLES:]
        return replace(self, loads=loads, growth=growth)

    def as_status(self) -> dict[str, Any]:
        """What outlives the operator, for `status.learnedBursts`."""
        return {
            "hourlyGrowth": [{"since": now_iso(t), "ratio": round(r, 4)} for t, r in self.growth],
            "podStartSeconds": [round(s, 1) for s in self.starts],
        }

    @classmethod
    def from_status(cls, status: Any, now: float) -> Bursts:
        """What `as_status` wrote, as far as it is sound: entries that are not (a time, a finite
        ratio of at least 1), starts that are not seconds, hours older than a day or in the future
        are left out (a status is anyone's to edit); the rest ordered and bounded as learned."""
        if not isinstance(status, dict):
            return cls()
        day = now - GROWTH_BLOCKS * GROWTH_BLOCK_S
        growth = []
        for entry in _list(status.get("hourlyGrowth")):
            if not isinstance(entry, dict):
                continue
            t, ratio = from_iso(entry.get("since")), _finite(entry.get("ratio"))
            if t is not None and ratio is not None and ratio >= 1.0 and day < t <= now:
                growth.append((t, ratio))
        growth.sort()
        starts = [s for s in map(_finite, _list(status.get("podStartSeconds")))
                  if s is not None and 0.0 < s <= MAX_START_S]
        return cls(growth=tuple(growth[-GROWTH_BLOCKS:]), starts=tuple(starts[-START_SAMPLES:]))

    def _around(self, t: float) -> float | None:
        """The higher of the newest load sample at or before `t` (one second of slack) and the one
        before it; None when there is none within PAIR_SLACK_S of `t`."""
        i = bisect.bisect_right(self.loads, t + 1.0, key=lambda s: s[0])
        if i == 0 or self.loads[i - 1][0] < t - PAIR_SLACK_S:
            return None
        return max(x for _, x in self.loads[max(i - 2, 0) : i])

    def factor(self, now: float) -> float:
        """The learned growth within one start; 1 when none."""
        return self.learned(now)[0]

    def learned(self, now: float) -> tuple[float, int, int]:
        """The learned growth (GROWTH_QUANTILE of the hourly highest of the last day, nearest
        rank, at least 1), the hours whose highest reached it, and the hours seen."""
        day = now - GROWTH_BLOCKS * GROWTH_BLOCK_S
        highest = sorted(r for t, r in self.growth if t > day)
        if not highest:
            return 1.0, 0, 0
        rank = math.ceil(GROWTH_QUANTILE * len(highest))
        return max(1.0, highest[rank - 1]), len(highest) - rank + 1, len(highest)

    def reference(self) -> float | None:
        """The load growth counts from: the lower of the newest sample and the median."""
        if not self.loads:
            return None
        values = sorted(x for _, x in self.loads)
        return min(self.loads[-1][1], values[(len(values) - 1) // 2])


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _highest(
    growth: tuple[tuple[float, float], ...], now: float, ratio: float
) -> tuple[tuple[float, float], ...]:
    """The hourly highest growth with this sample: the newest hour's raised, or a new hour begun
    (and hours older than a day forgotten)."""
    if growth and now < growth[-1][0] + GROWTH_BLOCK_S:
        return (*growth[:-1], (growth[-1][0], max(growth[-1][1], ratio)))
    day = now - GROWTH_BLOCKS * GROWTH_BLOCK_S
    return (*(b for b in growth if b[0] > day), (now, ratio))[-GROWTH_BLOCKS:]


@dataclass(frozen=True)
class Headroom:
    """The pods that carry the learned growth of the load until a scale-up's pods serve."""

    growth: float  # learned growth within one start
    start_s: float
    hours: int  # hours of the last day whose highest growth reached `growth`
    of_hours: int  # hours learned from (at most a day)
    line: float  # share of their capacity the pods may reach after the growth
    pods: int

    def says(self) -> str:
        when = (
            f"in {self.hours} of the last {self.of_hours} hours" if self.of_hours > 1 else "in the last hour"
        )
        return (
            f"load grew {self.growth:.1f}x within {self.start_s:.0f} s {when}; "
            f"{self.pods} pods carry {self.growth:.1f}x the load at {self.line:.0%} of their capacity"
        )


def headroom(bursts: Bursts, now: float, default_start_s: float, line: float) -> Headroom | None:
    """The pods that carry the learned growth of the reference load at `line` of their capacity;
    None until a growth is learned."""
    reference = bursts.reference()
    growth, hours, of_hours = bursts.learned(now)
    if reference is None or not of_hours or line <= 0:
        return None
    pods = math.ceil(min(growth * reference / line, 1e12) - 1e-9)  # finite whatever the load
    return Headroom(growth, bursts.start_s(default_start_s), hours, of_hours, line, pods)
