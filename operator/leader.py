"""Leader election on a coordination.k8s.io/v1 Lease, so that of several operator replicas exactly
one acts; the others wait, writing nothing but their attempts on the Lease.

The protocol is client-go's (k8s.io/client-go/tools/leaderelection), on the operator's own API
client:
- the Lease's spec is the record: holderIdentity, leaseDurationSeconds, acquireTime, renewTime,
  leaseTransitions;
- a candidate may take the Lease when it has no holder, or when its record has not changed for
  leaseDuration on the candidate's own clock (never by comparing renewTime with its clock:
  clocks of two nodes differ);
- every write is an update (PUT) carrying the resourceVersion that was read, so of two
  candidates racing, the API server lets exactly one through (409 Conflict for the other);
- the leader renews every retry period and gives up leading when it could not renew for the
  renew deadline, which is shorter than the lease duration: it stops acting before anyone else
  may start. On a graceful stop it releases the Lease (no holder) so a standby takes over at once.

Why not a library: the official client's `kubernetes.leaderelection` is threaded, sleeps without
a way to stop it, never counts leaseTransitions, writes naive local times as UTC and configures
the root logger on import, and it would bring the whole synchronous client into the slim image
with credentials of its own; kopf's peering is not a lock (two replicas can both act).
Like client-go's, this cannot fence a leader whose process is frozen past the lease duration.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .kube import ApiError, KubeApi, NotFound, api_path

log = logging.getLogger("tandem.operator.leader")
LEASES = ("coordination.k8s.io/v1", "leases")
JITTER = 1.2  # client-go's JitterFactor: retries wait retry_period x (1 to 1.2)


class LeadershipLost(Exception):
    """The Lease could not be renewed within the renew deadline: this replica must stop acting."""


@dataclass(frozen=True)
class Timings:
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def check(self) -> None:
        if not self.lease_duration_s > self.renew_deadline_s > self.retry_period_s * JITTER > 0:
            raise ValueError("lease duration > renew deadline > 1.2 x retry period > 0 is required")


def micro_time(ts: float) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with microseconds."""
    when = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self, api: KubeApi, namespace: str, name: str, identity: str, timings: Timings = Timings()
    ) -> None:
        timings.check()
        self.api, self.identity, self.timings = api, identity, timings
        self.name, self.namespace = name, namespace
        self.observed: dict | None = None  # the Lease's spec as last read or written
        self.observed_at = 0.0  # monotonic time it was read or written (this replica's clock)
        self.renewed_at: float | None = None  # monotonic time of the last successful renewal

    def _path(self, name: str | None = None) -> str:
        return api_path(*LEASES, self.namespace, name)

    def leading(self) -> bool:
        """Whether this replica may act now: it renewed within the renew deadline."""
        return (
            self.renewed_at is not None and time.monotonic() - self.renewed_at < self.timings.renew_deadline_s
        )

    async def try_acquire_or_renew(self) -> bool:
        now_wall, now = time.time(), time.monotonic()
        # Each call ends within the renew deadline: a hung request must not keep a leader leading.
        timeout = self.timings.renew_deadline_s
        record = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.timings.lease_duration_s)),
            "acquireTime": micro_time(now_wall),
            "renewTime": micro_time(now_wall),
            "leaseTransitions": 0,
        }
        try:
            lease = await self.api.get(self._path(self.name), timeout=timeout)
        except NotFound:
            body = {
                "apiVersion": LEASES[0],
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": record,
            }
            try:
                await self.api.create(self._path(), body, timeout=timeout)
            except (ApiError, OSError, asyncio.TimeoutError) as exc:  # 409: another one was first
                log.debug(f"could not create the Lease: {exc}")
                return False
            self._observe(record, now)
            return True
        except (ApiError, OSError, asyncio.TimeoutError) as exc:
            log.warning(f"could not read the Lease {self.namespace}/{self.name}: {exc}")
            return False

        old = lease.get("spec") or {}
        if old != self.observed:
            self._observe(old, now)
        holder = old.get("holderIdentity") or ""
        if holder and holder != self.identity and now < self.observed_at + self.timings.lease_duration_s:
            return False  # held by another one, and not expired on this replica's clock
        if holder == self.identity:
            record["acquireTime"] = old.get("acquireTime") or record["acquireTime"]
            record["leaseTransitions"] = int(old.get("leaseTransitions") or 0)
        else:
            record["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + 1
        if not await self._update(lease, record, timeout):
            return False
        self._observe(record, now)
        if holder != self.identity:
            log.info(
                f"{self.identity} acquired the Lease {self.namespace}/{self.name} (was {holder or 'free'})"
            )
        return True

    def _observe(self, spec: dict, now: float) -> None:
        self.observed, self.observed_at = dict(spec), now

    async def _update(self, lease: dict, record: dict, timeout: float) -> bool:
        """PUT with the resourceVersion read: the API server refuses it if anyone wrote since."""
        meta = lease.get("metadata") or {}
        body = {**lease, "spec": {**(lease.get("spec") or {}), **record}}
        body["metadata"] = {**meta, "resourceVersion": meta.get("resourceVersion")}
        try:
            await self.api.put(self._path(self.name), body, timeout=timeout)
        except (NotFound, ApiError, OSError, asyncio.TimeoutError) as exc:
            log.debug(f"could not update the Lease: {exc}")
            return False
        return True

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this replica holds the Lease (True), or until `stop` is set (False)."""
        log.info(f"{self.identity} waits for the Lease {self.namespace}/{self.name}")
        while not stop.is_set():
            if await self.try_acquire_or_renew():
                self.renewed_at = time.monotonic()
                return True
            await _wait(stop, self.timings.retry_period_s * random.uniform(1.0, JITTER))
        return False

    async def renew_while(self, task: asyncio.Task) -> None:
        """Renew until `task` ends; raise LeadershipLost when the renew deadline passes first."""
        while not task.done():
            await _wait_task(task, self.timings.retry_period_s)
            if task.done():
                return
            if await self.try_acquire_or_renew():
                self.renewed_at = time.monotonic()
            assert self.renewed_at is not None
            if time.monotonic() - self.renewed_at >= self.timings.renew_deadline_s:
                raise LeadershipLost(
                    f"{self.identity} could not renew the Lease {self.namespace}/{self.name}"
                )

    async def release(self) -> None:
        """Leave the Lease without a holder, so that a standby need not wait for it to expire."""
        if not self.leading():
            return
        self.renewed_at = None
        try:
            lease = await self.api.get(self._path(self.name), timeout=self.timings.retry_period_s)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            released = {**(self.observed or {}), "holderIdentity": "", "leaseDurationSeconds": 1}
            released["renewTime"] = released["acquireTime"] = micro_time(time.time())
            await self._update(lease, released, self.timings.retry_period_s)
        except (ApiError, OSError, asyncio.TimeoutError) as exc:  # then it expires instead
            log.warning(f"could not release the Lease: {exc}")

    async def run(self, lead: Callable[[], Awaitable[None]], stop: asyncio.Event) -> None:
        """Wait for the Lease, then run `lead()` while holding it. Returns when `lead()` returns
        or `stop` is set (releasing the Lease); raises LeadershipLost (lead() cancelled) when it
        could not be renewed."""
        if not await self.acquire(stop):
            return
        task = asyncio.ensure_future(lead())
        try:
            await self.renew_while(task)
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.release()
        task.result()  # lead()'s own failure, if it had one


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


async def _wait_task(task: asyncio.Task, seconds: float) -> None:
    await asyncio.wait({task}, timeout=seconds)
