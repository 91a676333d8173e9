"""The machine and checkout a benchmark ran on, without importing torch (which takes seconds)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import _repo


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def source_version() -> str | None:
    """The checkout's commit, '+dirty' when service/ has uncommitted changes (None without git)."""
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", "-C", str(_repo.REPO), *args], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()

        dirty = git("status", "--porcelain", "service")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    return {
        "commit": source_version(),
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
    }


def versions(*packages: str) -> dict[str, str | None]:
    """Installed versions, read from the package metadata (nothing is imported)."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
