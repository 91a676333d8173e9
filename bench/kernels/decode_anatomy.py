"""What holds the paged decode kernel's bandwidth: its loop taken apart, one part at a time.

One bench-only Triton kernel walks each (sequence, KV head, split) of a decode step as the engine's
split kernel does (service/engine/ops/triton_decode.py: the same grid, tiles and block-table
lookups) and does only the part of the work its MODE names:

- `read`: load K and V through the block table and add them up: the bandwidth this access pattern
  reaches with no math to wait for;
- `contiguous`: the same loads with each sequence's slots in one run (no table read): what the
  table's dependent load costs;
- `words`: the `read` loads with the cache taken as 32-bit words (four e4m3 or two bf16 values an
  element): what the loads cost per element the kernel handles rather than per byte;
- `dequant` (an e4m3 cache only): the loads and each tile dequantized to the query's dtype as the
  engine's loop does it (float32, times the layer's scale): what the conversion costs;
- `scores`: the loads, Q.K^T (tl.dot) and the running max;
- `softmax`: and the exponentials and their sum;
- `full`: and P.V: the engine's loop (no new K/V, no rotary);
- `fma`: the whole loop on the CUDA cores (broadcast products summed), query heads unpadded.

Over an e4m3 cache (`kv_scales` given) every part from `dequant` on dequantizes its tiles as the
engine's kernel does. Each program stores its split's normalised output: with one split per
sequence that is the attention output, which is how the whole-loop modes are checked against the
engine's kernel. Triton is imported here, so profile_gpu.py (--decode-anatomy) imports this
module only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.service.engine.ops.decode_grid import Splits
from tandem.service.engine.ops.triton_decode import (
    _attend_tile,
    _load_tile,
    _splits_of,
    _tile_range,
)
from tandem.service.engine.ops.triton_fp8 import dequantize

MODES = ("read", "contiguous", "words", "dequant", "scores", "softmax", "full", "fma")
WHOLE_LOOP = ("full", "fma")  # the modes that compute attention
FP8_ONLY = ("dequant",)  # the modes that time an e4m3 cache's own work
# the kernel's MODE values (globals a Triton kernel reads must be constexpr)
READ, CONTIGUOUS, WORDS, DEQUANT, SCORES, SOFTMAX, FULL, FMA = (tl.constexpr(i) for i in range(len(MODES)))


@triton.jit(do_not_specialize=["least_splits", "num_splits"])
def _anatomy_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    scale,
    least_splits,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    MODE: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + b)
    splits = _splits_of(ctx_len, least_splits, num_splits, SPLIT_TOKENS)
    if split >= splits:
        return
    first_tile, last_tile = _tile_range(ctx_len, split, splits, TILE)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, TILE)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=g_ok[:, None], other=0.0)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.full([GROUP_PAD], 1.0, tl.float32)
    if MODE >= SOFTMAX:
        lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in tl.range(first_tile, last_tile):
        if MODE == CONTIGUOUS:  # the slots a table of consecutive blocks would give, not read from it
            pos = tile * TILE + t
            live = pos < ctx_len
            kv_off = (b * stride_tb * BLOCK_SIZE + pos)[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0)
        else:  # the engine's own tile load
            pos, live, k, v = _load_tile(k_ptr, v_ptr, table_ptr, b, kvh, tile, ctx_len, t, d, stride_tb,
                                         stride_ks, stride_kh, BLOCK_SIZE, TILE, False)
        if KV_FP8 and MODE >= DEQUANT:  # as the engine's loop reads an e4m3 tile
            k = dequantize(k, k_scale, q_ptr.dtype.element_ty)
            v = dequantize(v, v_scale, q_ptr.dtype.element_ty)
        if MODE <= DEQUANT:
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)[None, :]
        elif MODE == FMA:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
            s = tl.where(live[None, :], s, float("-inf"))  # [GROUP_PAD, TILE]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m = m_new
        elif MODE == FULL:  # the engine's step
            m, lsum, acc = _attend_tile(q, k, v, live, m, lsum, acc, scale, 1.0, DOT_PRECISION, False)
        else:  # the parts without P.V: V still read (added up), so its load is not dropped
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            if MODE == SOFTMAX:
                lsum = lsum * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
            acc += tl.sum(v.to(tl.float32), axis=0)[None, :]
            m = m_new
    if MODE == SCORES or MODE == SOFTMAX:  # keep what they computed alive
        out = acc + (m + lsum)[:, None]
    else:
        out = acc / lsum[:, None]
    out_off = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptr + out_off, out, mask=g_ok[:, None])


@dataclass(frozen=True)
class Part:
    """One configuration of the anatomy kernel: what it does (MODES), its tile, warps, and
    Triton's software-pipeline stages of the tile loop (the K/V of the next tiles loaded into
    shared memory while the math runs on this one)."""

    mode: str
    tile: int
    warps: int
    stages: int = 1


def group_pad(mode: str, group: int) -> int:
    """Query-head rows per program: padded to tl.dot's 16 but on the CUDA cores (`fma`)."""
    pow2 = triton.next_power_of_2(group)
    return pow2 if mode == "fma" else max(16, pow2)


def launch(
    part: Part,
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D] (any layout's view)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, width]
    ctx_lens: torch.Tensor,  # [B]
    block_size: int,
    scale: float,
    splits: Splits,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an e4m3 cache's (0-d float32)
) -> tuple[torch.Tensor, object]:
    """-> [B, H, splits.most, D] fp32, each split's normalised output (the parts short of `full`:
    sums that only keep their work alive), and the compiled kernel (None when interpreted)."""
    if part.mode in FP8_ONLY and kv_scales is None:
        raise ValueError(f"part {part.mode!r} reads an e4m3 cache: give its kv_scales")
    b, h, d = q.shape
    kv_heads = k_cache.shape[1]
    group = h // kv_heads
    out = torch.zeros(b, h, splits.most, d, dtype=torch.float32, device=q.device)
    head_dim = d
    if part.mode == "words":  # the same bytes, a 32-bit word an element (the output's first columns)
        k_cache, v_cache = k_cache.view(torch.int32), v_cache.view(torch.int32)
        head_dim = k_cache.shape[-1]
    kernel = _anatomy_kernel[(b, kv_heads, splits.most)](
        q,
        k_cache,
        v_cache,
        block_table,
        ctx_lens,
        *(kv_scales or (ctx_lens, ctx_lens)),  # unread without an e4m3 cache
        out,
        scale,
        splits.least,
        splits.most,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        MODE=MODES.index(part.mode),
        SPLIT_TOKENS=splits.tokens,
        GROUP=group,
        GROUP_PAD=group_pad(part.mode, group),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=part.tile,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_scales is not None,
        num_warps=part.warps,
        num_stages=part.stages,
    )
    return out, kernel


def run_part(part: Part, *args: object, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> torch.Tensor:
    """`launch`'s output alone (the call timed)."""
    return launch(part, *args, kv_scales=kv_scales)[0]


def resources(kernel: object, device: torch.device) -> dict:
    """A compiled part's registers, spills and shared memory, and so how many of its programs one
    multiprocessor holds at once (registers allocated per warp in units of 256, 1 KiB of shared
    memory reserved per program): the memory reads a multiprocessor can have in flight."""
    if not hasattr(kernel, "n_regs"):  # the interpreter compiles nothing
        return {}
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    shared = kernel.metadata.shared
    per_warp = -(-kernel.n_regs * 32 // 256) * 256
    limits = [32, getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
              getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)]
    if shared:
        limits.append(getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024))
    return {"registers": kernel.n_regs, "spills": kernel.n_spills, "shared_bytes": shared,
            "resident_per_sm": min(limits)}


def parts(kv_fp8: bool = False) -> list[Part]:
    """Every part at the engine's tiles (32, 64) and wider, in 4 and 8 warps, one stage as the
    engine runs; `fma` holds a [heads, tile, head_dim] product in registers, so its tiles are
    narrower. Then the loads and the whole loops software-pipelined, 2 to 4 stages deep. `kv_fp8`:
    over an e4m3 cache, its dequantization among the parts, and the loops 128-token tiles deep too
    (an e4m3 tile takes half a bf16 one's shared memory)."""
    out = []
    for mode in (m for m in MODES if kv_fp8 or m not in FP8_ONLY):
        tiles = (16, 32) if mode == "fma" else (32, 64, 128)
        out += [Part(mode, tile, warps) for tile in tiles for warps in (4, 8)]
    pipelined = ("read", "words", "dequant", "full") if kv_fp8 else ("read", "words", "full")
    tiles = (32, 64, 128) if kv_fp8 else (32, 64)
    for mode in pipelined:
        out += [Part(mode, tile, warps, stages)
                for stages in (2, 3, 4) for tile in tiles for warps in (4, 8)]
    return out
