"""How long the server took to start, phase by phase (the log, `tandem_startup_seconds{phase}`).

The phases, in the order they run:
- `spawn`: from the server process's start to the engine process's work: the CLI's imports, the
  supervisor's start, and the engine process's spawn and imports (torch, transformers);
- `weights`: the model read into memory and moved to the device;
- `kv_cache`: the engine assembled around it (the KV cache allocated, the scheduler, the runner);
- `compile`: the compiler's first run of each step shape (torch.compile, Triton kernels), outside
  graph capture;
- `graph_capture`: the decode CUDA graphs captured;
- `warm_up`: one short generation, so the first request pays for no lazy initialisation.
The server is SERVING once the engine is ready and every front has its tokenizer; the fronts start
beside the engine, so `serving` (from the process's start) is not the phases' sum when a front is
slower than the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("spawn", "weights", "kv_cache", "compile", "graph_capture", "warm_up")


def process_started_at() -> float:
    """Wall-clock time (epoch seconds) this process started: the kernel's record of it on Linux, else
    now (a process asks early in its life)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        ticks = int(fields[19])  # starttime: the 22nd field, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """Seconds spent in each phase; a phase timed twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"start-up phase {phase!r}: expected one of {PHASES}")
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, seconds)

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def summary(self) -> str:
        """'spawn 9.8 s, weights 2.1 s, ...' in the phases' order."""
        return ", ".join(f"{p} {self.seconds[p]:.1f} s" for p in PHASES if p in self.seconds)
