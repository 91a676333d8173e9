"""`tandem bench offload-bound`: what can offloading preempted sequences' K/V gain over recomputing
them? Exact schedules, modelled step times, over many oversubscribed shapes.

    tandem bench offload-bound [--shapes 128x1024+512@2,...] [--shape 8b]
    tandem bench offload-bound --smoke     # two small shapes: checks the logic

`tandem bench workloads --workloads oversubscribed` measures offload against recompute on the GPU,
one run per shape and mode. This answers the question behind its target (offload >= 1.3x the
throughput of recompute) over many shapes, on any host: the engine core's own scheduler runs each
shape twice (a host pool for preempted sequences' K/V, or none), with the forward replaced by a
token fill (`tandem bench host`'s), so each schedule is exactly the one the GPU runs (greedy,
`ignore_eos`: no token changes what is scheduled). Each step is then given the additive bound's time
on the modelled device (`--shape`'s weights and K/V at `--bandwidth`, its prompt tokens' GEMM work
at `--gemm-tflops`, the H200's measured rates by default), and offload's copies cost nothing.

So the modelled ratio (recompute's time over offload's) is what offload gains if every step runs
at its bound and copies are free. Real steps of both runs run at 60-80% of their bound, so the real
ratio is near the modelled one: lower where offload's copies stall a step or where recomputed
prompt work runs closer to its bound than the rest of the run, higher where it runs further from
it. `--budget` and `--max-num-seqs` are the server's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence

import torch

from tandem.bench.common import SHAPES, markdown_table
from tandem.bench.engine.harness import environment
from tandem.bench.engine.host_step import no_forward
from tandem.bench.engine.variants import build_model
from tandem.bench.prompts import fixed
from tandem.bench.record import ResultFile
from tandem.bench.workloads.bounds import Device, modelled_device
from tandem.bench.workloads.features import oversubscribed_shape
from tandem.bench.workloads.timed_run import BLOCK, fresh_scheduler, run
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core

SHAPES_DEFAULT = (
    "128x1024+512@2,48x256+2048@3,"  # the two shapes tandem bench workloads measures on the GPU
    "64x2048+2048@2,64x2048+2048@4,256x512+512@2,256x512+1024@4,"
    "32x4096+4096@2,32x4096+4096@4,128x256+4096@4,16x8192+8192@4,"
    "256x1024+1024@4,256x256+2048@4,256x2048+512@2,512x512+512@4,256x128+1024@8"
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench offload-bound", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES_DEFAULT,
                    help="REQUESTSxPROMPT+NEW@R: R = live context / what the cache holds")
    ap.add_argument("--shape", choices=["8b", "1b"], default="8b", help="the modelled device's model")
    ap.add_argument("--bandwidth", type=float, default=4.25, help="copy bandwidth, TB/s (H200, measured)")
    ap.add_argument("--gemm-tflops", type=float, default=735.0, help="dense bf16 GEMM, TFLOP/s (H200)")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per step (the server's)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_cpu_offload-bound_<shape>.json)")
    ap.add_argument("--smoke", action="store_true", help="two small shapes: checks the logic")
    a = ap.parse_args(argv)
    if a.smoke:
        a.shapes = "12x48+24@2,6x16+64@3"
    return a


def schedules(core: object, config: EngineConfig, work: object, cache: int, host_blocks: int, budget: int,
              spec: str, device: Device) -> dict:
    """The shape run with a host pool (`offload`) and without (`recompute`): each run's schedule."""
    runs = {}
    for mode, host in (("offload", host_blocks), ("recompute", 0)):
        fresh_scheduler(core, config, cache, True, host, budget)
        r = run(core, work, f"{spec}_{mode}")
        sched = core.scheduler
        runs[mode] = {
            "steps": len(r.steps),
            "prompt_tokens": sum(s["prompt"] for s in r.steps),
            "preemptions_offload": sched.preempted_offload,
            "preemptions_recompute": sched.preempted_recompute,
            "blocks_offloaded": sched.blocks_offloaded,
            # of the blocks that came back: copied in, or found still cached on the device;
            # and those never copied out (shared with a running sequence)
            "blocks_restored": sched.blocks_restored,
            "blocks_reused": sched.blocks_reused,
            "blocks_kept": sched.blocks_kept,
            "modelled_s": round(device.bound_s(r.steps), 3),
        }
    return runs


def shape_result(spec: str, count: int, prompt: int, new: int, ratio: float, cache: int, runs: dict,
                 device: Device) -> dict:
    off, rec = runs["offload"], runs["recompute"]
    recomputed = rec["prompt_tokens"] - off["prompt_tokens"]
    return {
        "shape": spec, "requests": count, "prompt": prompt, "new": new, "oversubscribed": ratio,
        "cache_tokens": cache * BLOCK, "offload": off, "recompute": rec,
        "recomputed_tokens": recomputed,
        "recomputed_share_of_prompt_work": round(recomputed / rec["prompt_tokens"], 4),
        "recompute_share_of_modelled_time": round(
            device.prompt_gemm_s(recomputed) / rec["modelled_s"], 4),
        "modelled_ratio": round(rec["modelled_s"] / off["modelled_s"], 4),
        "offloaded_GB": round(off["blocks_offloaded"] * BLOCK * device.kv_per_token / 1e9, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    result_file = ResultFile("offload-bound", argv, "cpu", a.shape, a.out,
                             tempfile.gettempdir() if a.smoke else None)
    torch.set_num_threads(2)
    device = modelled_device(a.shape, a.bandwidth * 1e12, a.gemm_tflops * 1e12)
    specs = [(spec, *oversubscribed_shape(spec)) for spec in a.shapes.split(",")]
    longest = max(p + n for _, _, p, n, _ in specs)
    blocks = max(-(-c * (p + n) // BLOCK) for _, c, p, n, _ in specs)
    tiny = build_model("tiny", torch.device("cpu"), torch.float32)  # its forward never runs
    config = EngineConfig(
        num_blocks=blocks, block_size=BLOCK, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.budget,
        max_model_len=longest + BLOCK, step_loop="async", prefix_caching=True, kv_offload_blocks=blocks,
    )
    core = build_core(tiny, config)
    no_forward(core)
    vocab = SHAPES[a.shape]["vocab_size"]  # the GPU run's token ids (the forward never reads them)
    results, rows = [], []
    for spec, count, prompt, new, ratio in specs:
        work = fixed(count, prompt, new, vocab, seed=11)
        cache = -(-int(work.live_tokens / ratio) // BLOCK)
        runs = schedules(core, config, work, cache, blocks, a.budget, spec, device)
        result = shape_result(spec, count, prompt, new, ratio, cache, runs, device)
        results.append(result)
        rows.append([spec, runs["recompute"]["preemptions_recompute"], result["recomputed_tokens"],
                     f"{result['recompute_share_of_modelled_time']:.1%}", f"{result['modelled_ratio']:.3f}x"])
        print(f"{spec}: modelled ratio {result['modelled_ratio']}", file=sys.stderr, flush=True)
    out = result_file.write({
        "benchmark": "offload_bound",
        "environment": environment(torch.device("cpu")),
        "modelled": {"shape": a.shape, "bandwidth_TBps": a.bandwidth, "gemm_TFLOPs": a.gemm_tflops,
                     "weight_GB": round(device.weight_bytes / 1e9, 3),
                     "kv_KiB_per_token": device.kv_per_token / 1024},
        "engine": {"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.budget, "block_size": BLOCK},
        "smoke": a.smoke,
        "shapes": results,
    })
    headers = ["shape (requests x prompt + new @ oversubscription)", "recompute preemptions",
               "recomputed tokens", "their share of the run", "offload's gain at the bound"]
    print(markdown_table(headers, rows))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
