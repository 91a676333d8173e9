"""The CPU cores this process may use: those its affinity allows, bounded by its cgroup's CPU quota (a
container's CPU limit, which the affinity does not show: a pod limited to 4 CPUs on a 64-core node
sees 64 cores)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _quota_v2(text: str) -> float | None:
    """cgroup v2's cpu.max, "QUOTA PERIOD" or "max PERIOD": the CPUs it allows (None: no limit)."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _quota_v1(quota: str, period: str) -> float | None:
    """cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us (a quota of -1: no limit)."""
    q = int(quota)
    return None if q < 0 else q / int(period)


def cgroup_v2_dirs(root: Path, proc_cgroup: str) -> list[Path]:
    """The process's cgroup v2 folder and its ancestors (a limit may sit on any of them)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            folder = root / line[3:].lstrip("/")
            return [folder, *folder.parents[: len(folder.relative_to(root).parts)]]
    return [root]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs the process's cgroup allows, the tightest of its own and its ancestors' quotas (cgroup
    v2), or of v1's cpu controller; None where no quota is set or none can be read."""
    limits: list[float] = []
    try:
        own = proc_cgroup.read_text()
    except OSError:
        own = ""
    for folder in {*cgroup_v2_dirs(root, own), root}:
        try:
            limit = _quota_v2((folder / "cpu.max").read_text())
        except (OSError, ValueError):
            continue
        if limit is not None:
            limits.append(limit)
    for controller in ("cpu", "cpu,cpuacct"):
        folder = root / controller
        try:
            quota = (folder / "cpu.cfs_quota_us").read_text()
            limit = _quota_v1(quota, (folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def usable_cores() -> int:
    """Cores the process may run on: its affinity, at most its CPU quota rounded down (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.floor(limit)))
    return cores
