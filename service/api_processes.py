"""How many front processes `tandem serve` starts: the setting `api_processes`, a number, or `auto` (the
default), sized from the cores the pod may use (cpus.py) and where the engine computes:

- the engine on the CPU: 1 front. The engine's tensor work runs on those cores and each front takes one
  from it (engine/factory.configure_threads); a front keeps up with a CPU engine's tokens.
- the engine on CUDA: one front per core beyond the ENGINE_CORES the engine process keeps for its step
  loop, at most MAX_AUTO_FRONTS, at least 1: 4 fronts from 6 cores up, 2 on 4 cores, 1 on 3 or fewer.
  One front caps HTTP streaming of a small model at many streams (docs/architecture.md, the rule and
  its measurements); past a few fronts the engine's own step is the bound.

Torch-free: the supervisor decides before any process has imported torch, so `device: auto` counts as
CUDA where an NVIDIA device is visible (a /dev/nvidia<N>, not hidden by CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .cpus import usable_cores
from .settings import ServerSettings

ENGINE_CORES = 2  # the engine process's step loop and its helper threads
MAX_AUTO_FRONTS = 4


def auto_api_processes(cores: int, on_cuda: bool) -> int:
    """The rule of `api_processes: auto`."""
    if not on_cuda:
        return 1
    return max(1, min(MAX_AUTO_FRONTS, cores - ENGINE_CORES))


def engine_on_cuda(device: str, env: Mapping[str, str] = os.environ, dev: Path = Path("/dev")) -> bool:
    """Whether the engine will compute on CUDA (`device` as the setting says it), without torch."""
    if device != "auto":
        return device == "cuda"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
        return False
    return any(dev.glob("nvidia[0-9]*"))


def api_processes(settings: ServerSettings) -> int:
    """The front processes the settings ask for, `auto` resolved."""
    if settings.api_processes != "auto":
        return settings.api_processes
    return auto_api_processes(usable_cores(), engine_on_cuda(settings.device))
