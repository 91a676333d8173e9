"""Lease objects with the API server's optimistic concurrency, which kmock does not have (it
serves no PUT and never changes a resourceVersion): GET, POST and PUT of one Lease, each write
giving it a new resourceVersion, a PUT whose resourceVersion is not the stored one refused with
409 Conflict, as the API server refuses it. Every accepted write is logged with the time."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import kmock as km


@dataclass
class Write:
    time: float  # this process's monotonic clock
    holder: str
    spec: dict


@dataclass
class LeaseServer:
    namespace: str
    name: str
    lease: dict | None = None
    version: int = 0
    writes: list[Write] = field(default_factory=list)
    conflicts: int = 0

    def install(self, kmock: Any) -> LeaseServer:
        base = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"
        kmock[f"get {base}/{self.name}"] << self._get
        kmock[f"post {base}"] << self._create
        kmock[f"put {base}/{self.name}"] << self._update
        return self

    def _store(self, body: dict) -> dict:
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        spec = self.lease.get("spec") or {}
        self.writes.append(Write(time.monotonic(), spec.get("holderIdentity") or "", dict(spec)))
        return self.lease

    def _get(self, request: km.Request) -> dict:
        if self.lease is None:
            raise km.KubernetesError(status=404, reason="NotFound", message="no such Lease")
        return self.lease

    def _create(self, request: km.Request) -> dict:
        if self.lease is not None:
            raise km.KubernetesError(status=409, reason="AlreadyExists", message="the Lease exists")
        return self._store(request.data)

    def _update(self, request: km.Request) -> dict:
        if self.lease is None:
            raise km.KubernetesError(status=404, reason="NotFound", message="no such Lease")
        if (request.data.get("metadata") or {}).get("resourceVersion") != self.lease["metadata"][
            "resourceVersion"
        ]:
            self.conflicts += 1
            raise km.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
        return self._store(request.data)

    def holder(self) -> str:
        return ((self.lease or {}).get("spec") or {}).get("holderIdentity") or ""

    def terms(self) -> list[tuple[str, float, float]]:
        """(holder, first write, last write) of each uninterrupted run of one holder."""
        runs: list[tuple[str, float, float]] = []
        for w in self.writes:
            if runs and runs[-1][0] == w.holder:
                runs[-1] = (w.holder, runs[-1][1], w.time)
            else:
                runs.append((w.holder, w.time, w.time))
        return runs
