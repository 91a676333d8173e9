"""Tandem's benchmarks, run as `tandem bench NAME` (or `python -m tandem.bench NAME`; from a source
checkout that is not installed, `python bench NAME`).

Grouped by what they load: engine/ (the engine core in-process: throughput against transformers
and the roofline, its host work, its CPU profile), kernels/ (the GPU kernels alone), workloads/
(the engine on real-shaped workloads, and their modelled schedules), serve/ (a running `tandem
serve` against the engine alone), soak/ (the server under long, messy load), autoscale/ (the
operator's policy, simulated) and accuracy/ (what FP8 costs in perplexity and greedy agreement).
Beside them: common.py (what they all share), prompts.py (the requests they send) and record.py
(the one writer of their results, into results/: data, not code).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

BENCHMARKS = {  # `tandem bench NAME`: the module of tandem.bench whose main(argv) runs it
    "gpu": "engine.gpu_sync",
    "fp8": "engine.fp8",
    "cpu": "engine.cpu_throughput",
    "structured": "engine.structured",
    "cpu-profile": "engine.profile_cpu",
    "host": "engine.host_step",
    "timeline": "engine.timeline",
    "serve": "serve.benchmark",
    "start": "serve.start",
    "soak": "soak.benchmark",
    "workloads": "workloads.features",
    "offload-bound": "workloads.offload_bound",
    "gpu-profile": "kernels.profile_gpu",
    "kernel-resources": "kernels.kernel_resources",
    "autoscale": "autoscale.compare",
    "accuracy": "accuracy.benchmark",
}
# the distribution that installs an importable name, where the two differ
DISTRIBUTIONS = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking", "yaml": "pyyaml"}


def main_of(name: str) -> Callable[[Sequence[str]], int]:
    """The main(argv) of `tandem bench NAME`."""
    return importlib.import_module(f"{__name__}.{BENCHMARKS[name]}").main


def run(name: str, argv: Sequence[str]) -> int:
    """`tandem bench NAME ARGV`; a library the benchmark needs and this host lacks (torch on the slim
    image, matplotlib, ...) ends it with one line naming it."""
    try:
        return main_of(name)(list(argv))
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if not missing or missing == "tandem":
            raise
        sys.exit(f"tandem bench {name} needs {missing}: pip install {DISTRIBUTIONS.get(missing, missing)}")
