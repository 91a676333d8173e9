"""Tandem's benchmarks, run as `tandem bench NAME` (tandem/cli.py names each one's module).

Grouped by what they load: engine/ (the engine core in-process: throughput against transformers
and the roofline, its host work, its CPU profile), kernels/ (the GPU kernels alone), workloads/
(the engine on real-shaped workloads, and their modelled schedules), serve/ (a running `tandem
serve` against the engine alone), soak/ (the server under long, messy load) and autoscale/ (the
operator's policy, simulated). Beside them: common.py (what they all share), prompts.py (the
requests they send) and record.py (the one writer of their results, into results/: data, not code).
"""
