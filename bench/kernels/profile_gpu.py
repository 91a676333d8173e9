"""`tandem bench gpu-profile`: where does a decode step's device time go on CUDA? Four views, one run:

1. the steady decode step of the real engine (CUDA graphs, compiled or not), profiled with
   torch.profiler: every kernel of a few steps, grouped by kind (GEMM, decode attention, fused
   Triton element-wise, copies), against the wall time of the step and its bandwidth roofline;
2. the GEMMs of a step alone at its batch size, with cuBLAS and cuBLASLt: achieved bandwidth of
   each weight read;
3. the paged decode attention kernel alone (--attention B:CONTEXTS,..., contexts `mixed` or a
   length), per cache layout (--layouts), tile, pipeline stages and warps at the engine's grid;
   and its split grids (--attention-grid B:CONTEXTS,...), and its loop taken apart part by part
   (--decode-anatomy B:CONTEXTS,...: kernels/decode_anatomy.py);
4. one layer's mixed attention op at a mixed step's composition (--mixed-op DECODES:PROMPT,...):
   the decode rows first, each part a slice of the step's rows (the engine's layout), against
   the same step gathered and scattered by index (the layout of a step whose rows interleave);
   and its write of the step's K/V: the index copies and the compiled model's rotary embedding
   of before against the write kernel (storing only, and rotating Q and K as it stores).

    tandem bench gpu-profile [--shape 8b] [--requests 32] [--prompt 640] [--steps 8]
                             [--engine compiled] [--trace steps.json] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.bench.common import markdown_table, need_cuda
from tandem.bench.engine import inductor_options
from tandem.bench.engine.gemm_floor import time_linear, timed
from tandem.bench.engine.harness import blocks_for, copy_bandwidth, environment
from tandem.bench.engine.precision import NAMED, model_bytes
from tandem.bench.engine.variants import VARIANTS, build_model
from tandem.bench.prompts import MIXED_OUTPUT, MIXED_PROMPT
from tandem.bench.record import ResultFile
from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.ops.decode_grid import (
    ENGINE_CONFIGS,
    MAX_SPLITS,
    SPLIT_TOKENS,
    KernelConfig,
    Splits,
    kernel_config,
    least_splits,
    num_splits_for,
    product_variants,
    register_capped,
)
from tandem.service.engine.ops.decode_op import num_sms
from tandem.service.engine.ops.deferred_rotary import defer_rotary, model_family
from tandem.service.engine.ops.e4m3 import quantize
from tandem.service.engine.ops.kv_cache import CacheShape


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "_decode_split" in n or "_merge_kernel" in n:
        return "decode attention"
    if "flash" in n:  # before the GEMM names: FlashAttention's kernels carry "cutlass" in theirs
        return "prefill attention (FlashAttention)"
    if any(k in n for k in ("gemm", "gemv", "nvjet", "cutlass", "sm90_", "splitk", "cublas")):
        return "GEMM (cuBLAS)"
    if "fp8_gemm" in n:
        return "GEMM (Triton FP8)"
    if n.startswith("triton_tem_"):
        return "GEMM (Triton)"
    if n.startswith("triton_"):
        return "fused element-wise (Triton)"
    if "memcpy" in n or "copy" in n or "memset" in n:
        return "copies"
    if "argmax" in n or "reduce" in n:
        return "reductions (sampling)"
    return "other"


def profile_steps(core, prompts: list[list[int]], steps: int, trace: Path) -> dict:
    """Run the requests into steady decode, then profile `steps` decode steps of the async loop."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add(Request(f"p{i}", list(p), params))
    launched = None
    for _ in range(20):  # prefill and the first decodes
        _, launched = core.step_ahead(launched)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            _, launched = core.step_ahead(launched)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    while core.scheduler.has_work or launched is not None:
        _, launched = core.step_ahead(launched)
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(float(e["dur"]))
    by_kind: dict[str, float] = defaultdict(float)
    for name, durs in by_name.items():
        by_kind[kernel_kind(name)] += sum(durs) / steps
    span = 0.0
    if kernels:
        span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / steps
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "wall_ms_per_step": round(1e3 * wall, 3),
        "kernel_span_ms_per_step": round(span / 1e3, 3),
        "kernel_busy_ms_per_step": round(sum(by_kind.values()) / 1e3, 3),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "by_kind_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n[:120], "kind": kernel_kind(n), "per_step": round(len(d) / steps, 1),
             "us_per_step": round(sum(d) / steps, 1), "us_each": round(sum(d) / len(d), 2)}
            for n, d in top
        ],
    }


def linear_bandwidth(model: torch.nn.Module, batch: int, bandwidth: float,
                     autotune: bool = False) -> list[dict]:
    """The GEMMs of a decode step (the engine's fused Q/K/V and gate/up, o, down, LM head) alone at
    `batch` rows, with each cuBLAS backend (and, with `autotune`, as Inductor's max-autotune
    compiles the linear for this row count: its Triton GEMM templates against cuBLAS): time and
    share of the copy bandwidth. Each call reads a different copy of the weight, as in a step (no
    weight served from L2)."""
    c, cache = model.config, CacheShape.of(model.config)
    q_out, kv_out = c.num_attention_heads * cache.head_dim, cache.num_kv_heads * cache.head_dim
    shapes = {"qkv_proj (fused)": (q_out + 2 * kv_out, c.hidden_size), "o_proj": (c.hidden_size, q_out),
              "gate_up_proj (fused)": (2 * c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}
    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    rows = []
    preferred = torch.backends.cuda.preferred_blas_library()
    for name, (out_f, in_f) in shapes.items():
        nbytes = out_f * in_f * dt.itemsize
        x = torch.randn(batch, in_f, dtype=dt, device=dev)
        row = {"linear": name, "shape": [out_f, in_f], "rows": batch}
        for backend in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(backend)
            seconds = time_linear(x, out_f, in_f)
            row[f"us_{backend}"] = round(1e6 * seconds, 1)
            row[f"of_bandwidth_{backend}"] = round(nbytes / seconds / bandwidth, 3)
        if autotune:  # the templates race the server's library (cuBLASLt) at this exact shape
            tuned = torch.compile(torch.nn.functional.linear, mode="max-autotune-no-cudagraphs",
                                  dynamic=False)
            seconds = time_linear(x, out_f, in_f, linear=tuned)
            row["us_autotuned"] = round(1e6 * seconds, 1)
            row["of_bandwidth_autotuned"] = round(nbytes / seconds / bandwidth, 3)
        rows.append(row)
    torch.backends.cuda.preferred_blas_library(preferred)
    return rows


DECODE_BLOCK = 16  # cache block size of the kernel sweeps (the engine's default)


@dataclasses.dataclass
class DecodeInputs:
    """One decode step's attention inputs on one layer's cache, blocks scattered in a random order."""

    caches: dict[str, list[torch.Tensor]]  # layout -> [K, V] as [slots, Hkv, D] views of its storage
    table: torch.Tensor  # [B, width] int32 block ids
    lens: torch.Tensor  # [B] int32 contexts, the new token included
    q: torch.Tensor  # [B, H, D]
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the step's K, V and their slots
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # an FP8 cache's (0-d float32)


# an FP8 sweep's cache scales: random values of about 1 quantized to e4m3 near its range's middle
SWEEP_KV_SCALES = (0.02, 0.03)


def decode_inputs(model: torch.nn.Module, lens_host: list[int], width: int,
                  layouts: tuple[str, ...] = ("NHD",), kv_fp8: bool = False) -> DecodeInputs:
    """`kv_fp8`: the caches in e4m3 (the values quantized with SWEEP_KV_SCALES), with their scales."""
    shape = CacheShape.of(model.config)
    heads, block = model.config.num_attention_heads, DECODE_BLOCK
    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    batch, heads_kv, dim = len(lens_host), shape.num_kv_heads, shape.head_dim
    slots_all = batch * width * block
    storage = {  # [slots, Hkv, D] views of each storage
        "NHD": lambda: torch.randn(slots_all, heads_kv, dim, dtype=dt, device=dev),
        "HND": lambda: torch.randn(heads_kv, slots_all, dim, dtype=dt, device=dev).transpose(0, 1),
    }
    caches = {layout: [storage[layout]() for _ in "kv"] for layout in layouts}
    scales = None
    if kv_fp8:
        scales = tuple(torch.tensor(x, device=dev) for x in SWEEP_KV_SCALES)
        caches = {layout: [quantize(t, x) for t, x in zip(kv, scales, strict=True)]
                  for layout, kv in caches.items()}
    table = torch.randperm(batch * width, device=dev, dtype=torch.int32).view(batch, width)
    lens = torch.tensor(lens_host, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, dim, dtype=dt, device=dev)
    new_k = torch.randn(batch, heads_kv, dim, dtype=dt, device=dev)
    last = lens.long() - 1  # each sequence's new token goes to its last position
    slots = table.gather(1, (last // block)[:, None])[:, 0].long() * block + last % block
    return DecodeInputs(caches, table, lens, q, (new_k, torch.randn_like(new_k), slots), scales)


KERNEL_CONFIGS = [  # 128-token tiles overflow shared memory past one stage
    KernelConfig(tile, stages, warps)
    for tile, stages, warps in itertools.product((32, 64, 128), (1, 2, 3, 4), (4, 8))
    if tile != 128 or stages == 1
] + [  # the step's own token after the loop
    KernelConfig(tile, stages, 4, new_after_loop=True) for tile in (32, 64) for stages in (1, 2, 3, 4)
] + [  # the new token after the loop in 1- and 2-warp programs (fewer or no cross-warp reductions)
    KernelConfig(tile, 2, warps, new_after_loop=True) for tile in (16, 32, 64) for warps in (1, 2)
]


# a mixed step's decode rows launch the kernel reading the cache only (no new K/V: the prompt
# step's write kernel stored it), which compiles to fewer registers (`tandem bench kernel-resources`)
CACHE_ONLY_CONFIGS = [KernelConfig(tile, stages, 4) for tile in (32, 64) for stages in (1, 2, 3)]


# an e4m3 tile takes half a bf16 one's shared memory: 128-token tiles pipeline too; and the products
# with e4m3 or float16 operands in the bf16 engine's configurations (those too) and those
FP8_KERNEL_CONFIGS = KERNEL_CONFIGS + [KernelConfig(128, stages, 4, new_after_loop=True) for stages in (2, 3)]
FP8_KERNEL_CONFIGS += [*ENGINE_CONFIGS, *product_variants([
    *ENGINE_CONFIGS, *(c for c in FP8_KERNEL_CONFIGS if c.tile == 128 and c.stages > 1)])]
FP8_CACHE_ONLY_CONFIGS = CACHE_ONLY_CONFIGS + product_variants(CACHE_ONLY_CONFIGS) + [
    *ENGINE_CONFIGS, *product_variants(ENGINE_CONFIGS)]
# the float16 products held to four programs resident (the compiler's choice holds three)
FP8_KERNEL_CONFIGS += register_capped([c for c in FP8_KERNEL_CONFIGS if c.f16_products and c.tile == 64])
FP8_CACHE_ONLY_CONFIGS += register_capped(
    [c for c in FP8_CACHE_ONLY_CONFIGS if c.f16_products and c.tile == 64 and c.stages < 3])


def decode_kernel_sweep(model: torch.nn.Module, batch: int, kind: str, bandwidth: float,
                        layouts: tuple[str, ...] = ("NHD",), kv_fp8: bool = False) -> list[dict]:
    """The split-K kernel alone on one layer's cache (writing the step's new K/V, as in a decode
    step) at the grid a captured step of `batch` rows uses (its table as wide as a 4,096-token
    context), contexts `mixed` or fixed: each configuration (tile, pipeline stages, warps, the
    step's own token after the loop or not) per cache layout,
    its time, share of the copy bandwidth and largest difference from the engine's
    configuration's output (marked `chosen`). Then (NHD) the kernel as a mixed step's decode rows
    launch it, reading the cache only, in 1-3 stages (`launch`: "cache only"). `kv_fp8`: over e4m3
    caches (128-token tiles pipelined too), the bytes read an e4m3 cache's."""
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    shape = CacheShape.of(model.config)
    block = DECODE_BLOCK
    lens_host = grid_contexts(kind, batch)
    width = -(-max(4096, max(lens_host)) // block)
    d = decode_inputs(model, lens_host, width, layouts, kv_fp8)
    table, lens, q, new_kv, scales = d.table, d.lens, d.q, d.new_kv, d.kv_scales
    sms = num_sms(q.device.index or 0)
    splits = num_splits_for(batch, shape.num_kv_heads, sms, longest=width * block)
    chosen = kernel_config(batch, kv_fp8)
    nbytes = 2 * sum(lens_host) * shape.num_kv_heads * shape.head_dim * d.caches["NHD"][0].element_size()
    configs, cache_only_configs = KERNEL_CONFIGS, CACHE_ONLY_CONFIGS
    if kv_fp8:
        configs, cache_only_configs = FP8_KERNEL_CONFIGS, FP8_CACHE_ONLY_CONFIGS
    rows = []
    for layout, (k, v) in d.caches.items():
        def run(config: KernelConfig, k=k, v=v) -> torch.Tensor:
            return paged_decode_attention(q, k, v, table, lens, block, 0.1, splits, new_kv, config=config,
                                          kv_scales=scales)
        reference = run(chosen).float()
        for config in with_engines(configs, chosen):
            row = {"layout": layout, **sweep_fields(config), "least": splits.least, "most": splits.most,
                   "chosen": layout == "NHD" and config == chosen}
            rows.append(timed_row(row, lambda config=config: run(config), reference, nbytes, bandwidth))
    k, v = d.caches["NHD"]
    # a mixed step's grid: every split of its longest context (the host knows it)
    step_splits = num_splits_for(batch, shape.num_kv_heads, sms, longest=max(lens_host))

    def cache_only(config: KernelConfig) -> torch.Tensor:
        return paged_decode_attention(q, k, v, table, lens, block, 0.1, step_splits, config=config,
                                      kv_scales=scales)

    chosen = kernel_config(batch, kv_fp8, store_new=False)
    reference = cache_only(chosen).float()
    for config in with_engines(cache_only_configs, chosen):
        row = {"layout": "NHD", "launch": "cache only", **sweep_fields(config), "least": step_splits.least,
               "most": step_splits.most, "chosen": config == chosen}
        rows.append(timed_row(row, lambda config=config: cache_only(config), reference, nbytes, bandwidth))
    return rows


def sweep_fields(config: KernelConfig) -> dict:
    """What a sweep's row records of the configuration it timed."""
    return {"tile": config.tile, "stages": config.stages, "warps": config.warps,
            "new_after_loop": config.new_after_loop, "single_split_direct": config.single_split_direct,
            "merge_heads": config.merge_heads, "max_registers": config.max_registers,
            "fp8_products": config.products}


def with_engines(configs: list[KernelConfig], chosen: KernelConfig) -> list[KernelConfig]:
    """A sweep's configurations, and the engine's among them (the row marked `chosen`)."""
    return configs if chosen in configs else [*configs, chosen]


def timed_row(row: dict, call: Callable[[], torch.Tensor], reference: torch.Tensor, nbytes: int,
              bandwidth: float) -> dict:
    """`row` with `call`'s time per call, its share of the copy bandwidth (`nbytes` read) and its
    largest difference from `reference`; or with the error of a configuration the compiler rejects
    (noted: the sweep goes on)."""
    try:
        diff = (call().float() - reference).abs().max().item()
        seconds = timed(call)
    except Exception as exc:
        return {**row, "error": str(exc)[:200]}
    return {**row, "us": round(1e6 * seconds, 1), "of_bandwidth": round(nbytes / seconds / bandwidth, 3),
            "max_diff": diff}


def grid_contexts(kind: str, batch: int, seed: int = 1) -> list[int]:
    """Each sequence's context at one decode step: `mixed` (a prompt of the mixed workload and part of
    its answer, prompts.py) or a fixed length ("512")."""
    if kind != "mixed":
        return [int(kind)] * batch
    rng = random.Random(seed)
    return [MIXED_PROMPT.draw(rng) + rng.randrange(MIXED_OUTPUT.draw(rng)) + 1 for _ in range(batch)]


def splits_by_batch_alone(batch: int, kv_heads: int, num_sms: int) -> Splits:
    """A captured decode step's grid sized by its batch alone, not by its table: about 16 programs
    per multiprocessor, whatever the contexts (the baseline of `decode_grid_sweep`)."""
    least = least_splits(batch, kv_heads, num_sms)
    return Splits(least, max(least, min(MAX_SPLITS, 16 * num_sms // (batch * kv_heads))))


def decode_grid_sweep(model: torch.nn.Module, batch: int, kind: str, bandwidth: float,
                      kv_fp8: bool = False) -> list[dict]:
    """The engine's kernel configuration at one batch size over grids of more and more splits: the
    rule graph-captured steps use (their longest context: the block table's width) against the grid
    sized by the batch alone, fixed grids, the rule with other tokens per split (more, shorter
    splits or fewer, longer ones) and the engine's grid with its merge in 1 or 2 warps per program
    or with 4-32 query heads per program, with a one-split sequence's output written by its program
    (the merge skipping it), with the step's own token after the loop in two stages, on one layer's
    cache; each with its largest difference from the engine's output. `kv_fp8`: over e4m3 caches
    (the bytes read an e4m3 cache's)."""
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    shape = CacheShape.of(model.config)
    block = DECODE_BLOCK
    lens_host = grid_contexts(kind, batch)
    width = -(-max(4096, max(lens_host)) // block)  # a table as wide as a 4,096-token context
    d = decode_inputs(model, lens_host, width, kv_fp8=kv_fp8)
    (k, v), table, lens, q, new_kv, scales = d.caches["NHD"], d.table, d.lens, d.q, d.new_kv, d.kv_scales
    sms = num_sms(q.device.index or 0)
    by_batch = splits_by_batch_alone(batch, shape.num_kv_heads, sms)
    engine = num_splits_for(batch, shape.num_kv_heads, sms, longest=width * block)
    grids = {"batch only": by_batch, "engine (longest = table)": engine,
             # a table of one split's context (512 tokens): one split per sequence at large batches
             "one split's table": num_splits_for(batch, shape.num_kv_heads, sms, longest=SPLIT_TOKENS)}
    for most in (2, 4, 8, 16, 32):
        if most > by_batch.least:
            grids[f"most {most}"] = Splits(by_batch.least, most)
    for tokens in (256, 1024):  # the engine's rule with other tokens per split (its 512), up to 128 splits
        grids[f"engine, {tokens} tokens per split"] = num_splits_for(
            batch, shape.num_kv_heads, sms, width * block, tokens=tokens, cap=128)
    nbytes = 2 * sum(lens_host) * shape.num_kv_heads * shape.head_dim * k.element_size()
    chosen = kernel_config(batch, kv_fp8)
    # the engine's grid with its merge in fewer warps per program (more programs resident at once)
    runs = {name: (splits, chosen) for name, splits in grids.items()}
    for warps in (1, 2):
        runs[f"engine, merge warps {warps}"] = (engine, dataclasses.replace(chosen, merge_warps=warps))
    # and with several query heads of a sequence per merge program (fewer, larger programs)
    for heads, warps in ((4, 4), (4, 2), (8, 4), (32, 4)):
        runs[f"engine, merge heads {heads}, warps {warps}"] = (
            engine, dataclasses.replace(chosen, merge_warps=warps, merge_heads=heads))
    # a one-split sequence's output from its own program, the merge skipping it; and both with the
    # step's own token after the loop in two stages (the candidate of `tandem bench kernel-resources`)
    after = dataclasses.replace(chosen, stages=2, new_after_loop=True)
    direct = dataclasses.replace(chosen, single_split_direct=True)
    runs["engine, one-split sequences direct"] = (engine, direct)
    runs["engine, new token after the loop, 2 stages"] = (engine, after)
    runs["engine, after the loop, 2 stages, one-split direct"] = (
        engine, dataclasses.replace(after, single_split_direct=True))
    reference = paged_decode_attention(q, k, v, table, lens, block, 0.1, engine, new_kv,
                                       kv_scales=scales).float()
    rows = []
    for name, (splits, config) in runs.items():
        def call(splits=splits, config=config) -> torch.Tensor:
            return paged_decode_attention(q, k, v, table, lens, block, 0.1, splits, new_kv, config=config,
                                          kv_scales=scales)
        diff = (call().float() - reference).abs().max().item()
        seconds = timed(call)
        rows.append({"grid": name, "least": splits.least, "most": splits.most, "tokens": splits.tokens,
                     "merge_warps": config.merge_warps, "merge_heads": config.merge_heads,
                     "stages": config.stages, "new_after_loop": config.new_after_loop,
                     "single_split_direct": config.single_split_direct,
                     "us": round(1e6 * seconds, 1),
                     "of_bandwidth": round(nbytes / seconds / bandwidth, 3), "max_diff": diff})
    return rows


def decode_anatomy_sweep(model: torch.nn.Module, batch: int, kind: str, bandwidth: float,
                         kv_fp8: bool = False) -> list[dict]:
    """The decode kernel's loop taken apart (decode_anatomy.py) at the grid of a step's own
    longest context, per cache layout: each part's time and share of the copy bandwidth in every
    tile and warp count, beside the engine's kernel (no new K/V, and writing it); the whole-loop
    parts with their largest difference from the engine's output (one split per sequence).
    `kv_fp8`: over e4m3 caches (the bytes read an e4m3 cache's), their dequantization a part."""
    from tandem.bench.kernels.decode_anatomy import WHOLE_LOOP, launch, parts, resources, run_part
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    shape = CacheShape.of(model.config)
    block = DECODE_BLOCK
    lens_host = grid_contexts(kind, batch)
    width = -(-max(lens_host) // block)
    d = decode_inputs(model, lens_host, width, ("NHD", "HND"), kv_fp8)
    table, lens, q, new_kv, scales = d.table, d.lens, d.q, d.new_kv, d.kv_scales
    splits = num_splits_for(batch, shape.num_kv_heads, num_sms(q.device.index or 0), longest=max(lens_host))
    one = Splits(1, 1)
    nbytes = 2 * sum(lens_host) * shape.num_kv_heads * shape.head_dim * d.caches["NHD"][0].element_size()
    chosen = kernel_config(batch, kv_fp8)
    rows = []
    for layout, (k, v) in d.caches.items():
        reference = paged_decode_attention(q, k, v, table, lens, block, 0.1, one, kv_scales=scales).float()
        calls = {"engine": lambda k=k, v=v: paged_decode_attention(q, k, v, table, lens, block, 0.1, splits,
                                                                   kv_scales=scales),
                 "engine, writing new K/V": lambda k=k, v=v: paged_decode_attention(
                     q, k, v, table, lens, block, 0.1, splits, new_kv, kv_scales=scales)}
        for mode, call in calls.items():
            seconds = timed(call)
            rows.append({"layout": layout, "mode": mode, "tile": chosen.tile, "warps": chosen.warps,
                         "stages": chosen.stages, "least": splits.least, "most": splits.most,
                         "us": round(1e6 * seconds, 1),
                         "of_bandwidth": round(nbytes / seconds / bandwidth, 3), "max_diff": 0.0})
        for part in parts(kv_fp8):
            row = {"layout": layout, "mode": part.mode, "tile": part.tile, "warps": part.warps,
                   "stages": part.stages, "least": splits.least, "most": splits.most}

            def call(part=part, k=k, v=v, splits=splits) -> torch.Tensor:
                return run_part(part, q, k, v, table, lens, block, 0.1, splits, kv_scales=scales)
            try:
                diff = None
                if part.mode in WHOLE_LOOP:
                    alone = run_part(part, q, k, v, table, lens, block, 0.1, one, kv_scales=scales)[:, :, 0]
                    diff = (alone - reference).abs().max().item()
                row |= resources(launch(part, q, k, v, table, lens, block, 0.1, splits, scales)[1], q.device)
                seconds = timed(call)
            except Exception as exc:  # a configuration the compiler rejects: note it, go on
                rows.append({**row, "error": str(exc)[:200]})
                continue
            rows.append({**row, "us": round(1e6 * seconds, 1),
                         "of_bandwidth": round(nbytes / seconds / bandwidth, 3), "max_diff": diff})
    return rows


def fastest_parts(rows: list[dict]) -> list[dict]:
    """The anatomy's fastest configuration of each (layout, part), in one stage and pipelined, in
    the order they ran."""
    best: dict[tuple[str, str, bool], dict] = {}
    for r in rows:
        key = (r["layout"], r["mode"], r["stages"] > 1)
        if "us" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    return list(best.values())


def mixed_op_sweep(model: torch.nn.Module, decodes: int, prompt: int, chunks: int = 3) -> dict:
    """One layer's mixed attention op (write the step's K/V, the decode rows by the Triton kernel,
    the prompt chunks by one flash-attention call) on a step of `decodes` decode rows (the mixed
    workload's contexts) then `chunks` fresh prompts of `prompt` tokens in all, timed with the
    parts as slices of the step's rows and with the same step gathered and scattered by index."""
    from array import array

    from tandem.service.contract import Request
    from tandem.service.engine.batch import build_attention_metadata
    from tandem.service.engine.batch_builder import StepInputsBuilder
    from tandem.service.engine.ops.kv_cache import KVCache
    from tandem.service.engine.ops.mixed_op import attending, paged_mixed
    from tandem.service.engine.ops.triton_decode import DecodeKernel
    from tandem.service.engine.scheduler import ScheduledChunk
    from tandem.service.engine.sequence import Sequence
    from tandem.service.engine.step_buffers import StepBuffers

    shape = CacheShape.of(model.config)
    heads, block = model.config.num_attention_heads, DECODE_BLOCK
    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    contexts = grid_contexts("mixed", decodes)
    lengths = [prompt // chunks + (i < prompt % chunks) for i in range(chunks)]
    needs = [-(-n // block) for n in contexts + lengths]
    cache = KVCache(CacheShape(1, shape.num_kv_heads, shape.head_dim), sum(needs) + 8, block, dt, dev)
    free = torch.randperm(sum(needs) + 8).tolist()
    step = []
    for i, n in enumerate(contexts + lengths):
        seq = Sequence(Request(f"s{i}", [0] * n), [0] * n, n, seed=0, max_total_len=n + 1)
        seq.block_ids = array("i", [free.pop() for _ in range(-(-n // block))])
        step.append(ScheduledChunk(seq, n - 1, 1, samples=True) if i < decodes else
                    ScheduledChunk(seq, 0, n, samples=True))
    batch = StepInputsBuilder(block).build(step)
    width = max(needs)
    buf = StepBuffers(decodes + prompt, decodes + chunks, width, dev, cache.scratch_block, block)
    sms = num_sms(dev.index or 0)
    kernel = DecodeKernel.for_batch(cache, decodes, sms, max(contexts)) if decodes else None
    dev_batch = buf.upload(batch)
    meta = build_attention_metadata(batch, dev_batch, cache, None, kernel, varlen=buf.stage)
    rows = decodes + prompt
    q = torch.randn(1, rows, heads, shape.head_dim, dtype=dt, device=dev).transpose(1, 2)  # as the model's
    k = torch.randn(1, rows, shape.num_kv_heads, shape.head_dim, dtype=dt, device=dev).transpose(1, 2)
    v = torch.randn_like(k)

    def run() -> torch.Tensor:
        with attending(meta):
            return paged_mixed(q, k, v, cache.k_store, cache.v_store, 0, False, 0.1)

    def seconds(reps: int = 30) -> float:
        """Per call, launched from Python as a mixed step's op is (mixed steps are not graphed)."""
        run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps

    assert meta.num_decode_first == decodes
    sliced = run()
    us_sliced = 1e6 * seconds()
    _, rotary = defer_rotary(model, shape.head_dim)
    meta.rotary, meta.positions = rotary, dev_batch.positions  # Q and K rotated by the op
    us_sliced_rotating = 1e6 * seconds()
    meta.rotary = meta.positions = None
    meta.num_decode_first = None  # the same step by index
    indexed = run()
    us_indexed = 1e6 * seconds()
    return {"decodes": decodes, "prompt_tokens": prompt, "chunks": chunks,
            "us_sliced": round(us_sliced, 1), "us_sliced_rotating": round(us_sliced_rotating, 1),
            "us_indexed": round(us_indexed, 1),
            "max_diff": (sliced.float() - indexed.float()).abs().max().item(),
            **step_kv_write(model, q, k, v, cache, meta.slot_mapping, dev_batch.positions, rotary)}


def step_kv_write(model: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: object,
                  slots: torch.Tensor, positions: torch.Tensor, rotary: object) -> dict:
    """One layer's write of a step's K/V, device time each way: the two index copies and the compiled
    model's rotary embedding (cos and sin from positions, then transformers' apply, as Inductor fuses
    them into the prefill graph) of before, against the write kernel storing K/V alone, and rotating
    Q and K as it stores."""
    from tandem.service.engine.ops.triton_kv_write import write_step_kv

    k_cache, v_cache = cache.k[0], cache.v[0]
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # [T, heads, D]: the op's views
    family = model_family(model)
    rotary_emb = model.model.rotary_emb

    @torch.compile(dynamic=True)
    def model_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple:
        cos, sin = rotary_emb(q, positions[None])
        return family.apply_rotary_pos_emb(q, k, cos, sin)

    def index_copies() -> None:
        k_cache.index_copy_(0, slots, kt)
        v_cache.index_copy_(0, slots, vt)

    rotated_q, _ = model_rotary(q, k, positions)
    out, _ = write_step_kv(qt, kt, vt, k_cache, v_cache, slots, positions, rotary)
    return {
        "us_write_index_copies": round(1e6 * timed(index_copies), 1),
        "us_rotary_compiled": round(1e6 * timed(lambda: model_rotary(q, k, positions)), 1),
        "us_write_kernel": round(1e6 * timed(lambda: write_step_kv(qt, kt, vt, k_cache, v_cache, slots,
                                                                    None, None)), 1),
        "us_write_kernel_rotating": round(1e6 * timed(lambda: write_step_kv(qt, kt, vt, k_cache, v_cache,
                                                                             slots, positions, rotary)), 1),
        "rotated_q_max_diff": (out.float() - rotated_q[0].transpose(0, 1).float()).abs().max().item(),
    }


@dataclass
class Sweeps:
    """The kernel sweeps' rows so far, by point; with --no-step written after each point, so that a
    run cut short by a time limit keeps the points it finished."""

    result_file: ResultFile | None  # None: the step profile follows, and writes them all
    env: dict
    attention: dict = field(default_factory=dict)
    grids: dict = field(default_factory=dict)
    anatomy: dict = field(default_factory=dict)
    mixed_ops: list = field(default_factory=list)

    def save(self) -> None:
        if self.result_file is not None:
            self.result_file.write(
                {"benchmark": "profile_gpu", "environment": self.env, "attention": self.attention,
                 "decode_grids": self.grids, "decode_anatomy": self.anatomy, "mixed_op": self.mixed_ops})


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tandem bench gpu-profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["8b", "1b"], default="8b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=640, help="prompt tokens: the context the steps attend to")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    ap.add_argument("--engine", choices=list(VARIANTS), default="compiled",
                    help="a variant of `tandem bench gpu` (the server's CUDA default: compiled), profiled "
                         "in the asynchronous loop")
    ap.add_argument("--precision", choices=list(NAMED), default="bf16",
                    help="the profiled engine's linear layers and KV cache (bench/engine/precision.py)")
    ap.add_argument("--trace", default=None, help="Chrome trace of the profiled steps (default: a temp file)")
    inductor_options.add_option(ap)
    ap.add_argument("--out", default=None,
                    help="JSON result path (default: bench/results/<date>_<gpu>_gpu-profile_<shape>-<engine>-"
                         "<requests>.json, with --no-step <shape>-sweeps)")
    ap.add_argument("--attention", default="", metavar="B:CONTEXTS,...",
                    help="sweep the decode kernel's configurations (tile, stages, warps) at "
                         "these batch sizes, contexts `mixed` (the mixed workload's) or a length")
    ap.add_argument("--layouts", default="NHD", help="cache layouts of the --attention sweep (NHD,HND)")
    ap.add_argument("--attention-grid", default="", metavar="B:CONTEXTS,...",
                    help="time the decode kernel's split grids at these batch sizes, contexts `mixed` "
                         "(the mixed workload's) or a length")
    ap.add_argument("--decode-anatomy", default="", metavar="B:CONTEXTS,...",
                    help="time the decode kernel's loop part by part (kernels/decode_anatomy.py) at these "
                         "batch sizes, contexts `mixed` (the mixed workload's) or a length")
    ap.add_argument("--mixed-op", default="", metavar="DECODES:PROMPT,...",
                    help="time one layer's mixed attention op at these mixed-step compositions, its parts "
                         "as slices of the step's rows and by index")
    ap.add_argument("--linear-rows", default="", metavar="N,...",
                    help="time the step's linears at these row counts (default: --requests)")
    ap.add_argument("--linears-autotune", action="store_true",
                    help="also time each linear as Inductor's max-autotune compiles it for its row count "
                         "(Triton GEMM templates against cuBLAS)")
    ap.add_argument("--no-step", action="store_true", help="only the linears and the kernel sweeps")
    return ap.parse_args(argv)


def points(spec: str) -> list[tuple[int, str]]:
    """`B:CONTEXTS,...` -> (batch, contexts) per point."""
    return [(int(b), kind) for b, kind in (p.split(":") for p in spec.split(","))] if spec else []


def linears(a: argparse.Namespace, model: torch.nn.Module, bandwidth: float) -> list[dict]:
    rows_of_linears = [int(n) for n in a.linear_rows.split(",")] if a.linear_rows else [a.requests]
    rows = [r for n in rows_of_linears for r in linear_bandwidth(model, n, bandwidth, a.linears_autotune)]
    tuned = ["us autotuned", "of bandwidth"] if a.linears_autotune else []
    headers = ["linear", "weight", "rows", "us cuBLAS", "of bandwidth", "us cuBLASLt", "of bandwidth", *tuned]
    print(markdown_table(headers, [
        [r["linear"], r["shape"], r["rows"], r["us_cublas"], f"{r['of_bandwidth_cublas']:.0%}",
         r["us_cublaslt"], f"{r['of_bandwidth_cublaslt']:.0%}",
         *([r["us_autotuned"], f"{r['of_bandwidth_autotuned']:.0%}"] if tuned else [])]
        for r in rows]))
    return rows


def attention_sweeps(a: argparse.Namespace, model: torch.nn.Module, bandwidth: float, sweeps: Sweeps) -> None:
    kv_fp8 = NAMED[a.precision].kv_cache_dtype == "fp8"  # the sweep reads the precision's cache
    for batch, kind in points(a.attention):
        rows = decode_kernel_sweep(model, batch, kind, bandwidth, tuple(a.layouts.split(",")), kv_fp8)
        sweeps.attention[f"{batch}:{kind}"] = rows
        sweeps.save()
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        print(f"decode attention, batch {batch}, contexts {kind}: best 6 per layout, the engine's choice, "
              "and the cache-only launch (a mixed step's decode rows)")
        step = [r for r in ok if "launch" not in r]
        shown = [r for layout in ("NHD", "HND") for r in [r for r in step if r["layout"] == layout][:6]]
        shown += [r for r in step if (r["chosen"] or r.get("fp8_products", "-") != "-") and r not in shown]
        shown += [r for r in ok if "launch" in r]
        headers = ["layout", "launch", "tile", "stages", "warps", "new after loop", "FP8 products", "chosen",
                   "us (layer)", "of bandwidth", "max diff"]
        print(markdown_table(headers,
                             [[r["layout"], r.get("launch", "decode step"), r["tile"], r["stages"],
                               r["warps"], r["new_after_loop"], r.get("fp8_products", "-"), r["chosen"],
                               r["us"], f"{r['of_bandwidth']:.0%}", f"{r['max_diff']:.2g}"] for r in shown]))
        failed = [r for r in rows if "error" in r]
        if failed:
            print(f"{len(failed)} configurations failed, e.g. {failed[0]}")


def grid_sweeps(a: argparse.Namespace, model: torch.nn.Module, bandwidth: float, sweeps: Sweeps) -> None:
    for batch, kind in points(a.attention_grid):
        rows = sweeps.grids[f"{batch}:{kind}"] = decode_grid_sweep(
            model, batch, kind, bandwidth, NAMED[a.precision].kv_cache_dtype == "fp8")
        sweeps.save()
        print(f"decode attention split grids, batch {batch}, contexts {kind}")
        headers = ["grid", "least", "most", "tokens per split", "merge warps", "us (layer)", "of bandwidth",
                   "max diff"]
        print(markdown_table(headers, [[r["grid"], r["least"], r["most"], r["tokens"], r["merge_warps"],
                                        r["us"], f"{r['of_bandwidth']:.0%}", f"{r['max_diff']:.2g}"]
                                       for r in rows]))


def anatomy_sweeps(a: argparse.Namespace, model: torch.nn.Module, bandwidth: float, sweeps: Sweeps) -> None:
    for batch, kind in points(a.decode_anatomy):
        rows = sweeps.anatomy[f"{batch}:{kind}"] = decode_anatomy_sweep(
            model, batch, kind, bandwidth, NAMED[a.precision].kv_cache_dtype == "fp8")
        sweeps.save()
        print(f"decode kernel anatomy, batch {batch}, contexts {kind}: each part's fastest configuration, "
              "in one stage and pipelined")
        headers = ["layout", "part", "tile", "warps", "stages", "splits", "us (layer)", "of bandwidth",
                   "max diff", "registers", "shared KiB", "resident per SM"]
        print(markdown_table(headers, [
            [r["layout"], r["mode"], r["tile"], r["warps"], r["stages"], f"{r['least']}-{r['most']}", r["us"],
             f"{r['of_bandwidth']:.0%}", "-" if r["max_diff"] is None else f"{r['max_diff']:.2g}",
             r.get("registers", "-"), round(r["shared_bytes"] / 1024, 1) if "shared_bytes" in r else "-",
             r.get("resident_per_sm", "-")]
            for r in fastest_parts(rows)]))
        failed = [r for r in rows if "error" in r]
        if failed:
            print(f"{len(failed)} configurations failed, e.g. {failed[0]}")


def mixed_op_sweeps(a: argparse.Namespace, model: torch.nn.Module, sweeps: Sweeps) -> None:
    sweeps.mixed_ops += [mixed_op_sweep(model, *(int(x) for x in point.split(":")))
                         for point in (a.mixed_op.split(",") if a.mixed_op else [])]
    if not sweeps.mixed_ops:
        return
    rows = sweeps.mixed_ops
    print("one layer's mixed attention op: parts as slices of the step's rows (Q and K rotated by "
          "the model, and by the op), and by index")
    print(markdown_table(["decode rows", "prompt tokens", "us sliced", "us sliced, rotating",
                          "us by index", "max diff"],
                         [[r["decodes"], r["prompt_tokens"], r["us_sliced"], r["us_sliced_rotating"],
                           r["us_indexed"], f"{r['max_diff']:.2g}"] for r in rows]))
    print("one layer's write of the step's K/V (device time): before (index copies, the compiled "
          "model's rotary) and the write kernel")
    print(markdown_table(["decode rows", "prompt tokens", "us index copies", "us compiled rotary",
                          "us kernel, store", "us kernel, rotate + store", "rotated Q max diff"],
                         [[r["decodes"], r["prompt_tokens"], r["us_write_index_copies"],
                           r["us_rotary_compiled"], r["us_write_kernel"], r["us_write_kernel_rotating"],
                           f"{r['rotated_q_max_diff']:.2g}"] for r in rows]))


def step_profile(a: argparse.Namespace, model: torch.nn.Module, bandwidth: float) -> tuple[dict, int, Path]:
    """The steady decode steps of the engine variant, profiled: (their kernels by kind, context, trace)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size - 2, (a.requests, a.prompt), generator=g).tolist()
    spec = EngineConfig(blocks_for(a.requests, a.prompt + a.steps + 64, 16), 16, max(32, a.requests),
                        4096, step_loop="async")
    start = time.perf_counter()
    # the profiled steps run the asynchronous loop whatever the variant's own loop
    precision = NAMED[a.precision]
    core = build_core(model, dataclasses.replace(spec, **{**VARIANTS[a.engine], "step_loop": "async"},
                                                 **precision.engine()))
    print(f"engine {a.engine} ({a.precision}) built in {time.perf_counter() - start:.1f} s", flush=True)
    trace = Path(a.trace or tempfile.mktemp(suffix=".json"))
    steps = profile_steps(core, prompts, a.steps, trace)
    context = a.prompt + 20 + a.steps // 2
    weight_bytes = model_bytes(model)  # as built: FP8 layers read half
    kv_per_token = CacheShape.of(model.config).bytes_per_token(core.runner.cache.k_store.dtype)
    roof_ms = 1e3 * (weight_bytes + a.requests * context * kv_per_token) / bandwidth
    steps["roofline_ms_per_step"] = round(roof_ms, 3)
    print(f"step: wall {steps['wall_ms_per_step']} ms, kernels span {steps['kernel_span_ms_per_step']} ms, "
          f"busy {steps['kernel_busy_ms_per_step']} ms, {steps['kernels_per_step']} kernels; "
          f"roofline {roof_ms:.3f} ms")
    print(markdown_table(["kind", "ms per step"], list(steps["by_kind_ms"].items())))
    print(markdown_table(["kernel", "kind", "per step", "us per step", "us each"],
                         [[k["name"][:70], k["kind"], k["per_step"], k["us_per_step"], k["us_each"]]
                          for k in steps["top_kernels"]]))
    return steps, context, trace


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    need_cuda("gpu-profile", " to profile CUDA kernels")
    try:
        inductor = inductor_options.apply(a.inductor)
    except ValueError as exc:
        print(f"tandem bench gpu-profile: {exc}", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    engine = a.engine if a.precision == "bf16" else f"{a.engine}-{a.precision}"
    shape = f"{a.shape}-sweeps" if a.no_step else f"{a.shape}-{engine}-{a.requests}"
    result_file = ResultFile("gpu-profile", argv, device, shape, a.out)
    env = environment(device)
    bandwidth = copy_bandwidth(device)
    model = build_model(a.shape, device, dtype)
    print(f"{env['gpu']}: copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows_of_linears = linears(a, model, bandwidth)
    sweeps = Sweeps(result_file if a.no_step else None, env)
    attention_sweeps(a, model, bandwidth, sweeps)
    grid_sweeps(a, model, bandwidth, sweeps)
    anatomy_sweeps(a, model, bandwidth, sweeps)
    mixed_op_sweeps(a, model, sweeps)
    if a.no_step:
        sweeps.save()
        return 0
    steps, context, trace = step_profile(a, model, bandwidth)
    out = result_file.write(
        {"benchmark": "profile_gpu", "environment": env, "shape": a.shape, "engine": a.engine,
         "precision": a.precision, "inductor": inductor, "requests": a.requests, "context": context,
         "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
         "linears": rows_of_linears, "decode_attention": sweeps.attention, "decode_grids": sweeps.grids,
         "decode_anatomy": sweeps.anatomy, "mixed_op": sweeps.mixed_ops, "step": steps})
    print(f"wrote {out}; trace {trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
