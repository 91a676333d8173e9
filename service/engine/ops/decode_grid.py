"""The decode kernel's grid and launch configuration: how many programs share each sequence's
context (its splits) and how each program walks it (tile, stages, warps). Plain Python, apart
from the kernel (triton_decode.py), so the rules are tested on hosts without Triton."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

SPLIT_TOKENS = 512  # context tokens per split, past the fewest splits: the best count on the H200
MAX_SPLITS = 32


@dataclass(frozen=True)
class Splits:
    """How many programs share each sequence's context: `least` for every sequence, one more per
    `tokens` of its context, up to `most` (the grid's split dimension)."""

    least: int
    most: int
    tokens: int = SPLIT_TOKENS

    def of(self, ctx_len: int) -> int:
        """The splits of a sequence of `ctx_len` tokens (the kernel's `_splits_of`, on the host)."""
        return min(max(-(-ctx_len // self.tokens), self.least), self.most)


def least_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Enough programs to cover the device about twice, so that few sequences at long contexts
    keep every multiprocessor reading (bench/profile_gpu.py --attention; docs/benchmarks.md)."""
    return max(1, min(MAX_SPLITS, -(-2 * num_sms // (batch * kv_heads))))


def num_splits_for(batch: int, kv_heads: int, num_sms: int, longest: int, tokens: int = SPLIT_TOKENS,
                   cap: int = MAX_SPLITS) -> Splits:
    """Fixed per batch size and `longest` (graph-friendly); each sequence's count follows its
    context in the kernel.

    `longest`: the longest context in the step (a step run eagerly, as mixed steps are), or the
    longest any sequence may have (a captured decode step: its block table's width). The grid
    holds every split that context takes, whatever the batch size (up to about 64 programs per
    multiprocessor), so one long sequence among many short ones is not read by one program while
    the others wait; the programs a shorter context does not need return at once. `tokens` (a
    split per so many tokens) and `cap` (the most splits) are the engine's unless a sweep asks."""
    least = least_splits(batch, kv_heads, num_sms)
    most = min(-(-longest // tokens), max(1, 64 * num_sms // (batch * kv_heads)))
    return Splits(least, max(least, min(cap, most)), tokens)


@dataclass(frozen=True)
class KernelConfig:
    """How the split kernel walks a context: tokens per loop iteration (any block size: each token
    finds its block through the table), Triton's software-pipeline stages of that loop, warps per
    program, and whether a decode step's own token joins the softmax
    after the loop instead of being substituted into its tile (the loop's loads then plain, which
    frees registers and lets Triton pipeline them); whether a sequence whose context takes one
    split, in a grid of several, gets its output from that split's program (the merge then skips
    it: a captured step's grid is sized by its table, so short contexts would otherwise pay a
    merge of one partial); and the merge's warps per program and query heads per program (one
    sequence's: more heads, fewer and larger programs); and, over an e4m3 cache, whether P.V takes
    e4m3 operands (`pv_fp8`: V's tiles as stored, the probabilities rounded to e4m3) and
    Q.K^T (`qk_fp8`: K's tiles as stored, each query row rounded to e4m3), or both products take
    float16 operands (`f16_products`: K's and V's tiles widened from e4m3, which float16 holds
    exactly, the query and the probabilities in float16, the scales applied to the products'
    float32 results) instead of the tiles dequantized into the query's dtype; and the most registers a
    thread may hold (`max_registers`, ptxas' limit: more programs resident, what does not fit
    spilled), the compiler's choice where None."""

    tile: int = 32
    stages: int = 1
    warps: int = 4
    merge_warps: int = 4
    merge_heads: int = 1
    new_after_loop: bool = False
    single_split_direct: bool = False
    pv_fp8: bool = False
    qk_fp8: bool = False
    f16_products: bool = False
    max_registers: int | None = None

    @property
    def launch_options(self) -> dict[str, int]:
        """What Triton compiles the split kernel with: warps, pipeline stages and the register cap."""
        options = {"num_warps": self.warps, "num_stages": self.stages}
        if self.max_registers:
            options["maxnreg"] = self.max_registers
        return options

    @property
    def products(self) -> str:
        """Which products take other operands than the dequantized tiles: "-", "P.V", "Q.K^T",
        "both" (e4m3) or "float16"."""
        if self.f16_products:
            return "float16"
        return {(False, False): "-", (True, False): "P.V", (False, True): "Q.K^T", (True, True): "both"}[
            self.pv_fp8, self.qk_fp8]


# The step's own token after the loop (fewer registers: more programs resident, loads free to
# pipeline), four query heads per merge program, and in two stages a one-split sequence's output
# from its own program: each chosen side by side with the kernel before it (docs/benchmarks.md)
PIPELINED = KernelConfig(tile=64, stages=2, new_after_loop=True, merge_heads=4, single_split_direct=True)
ONE_STAGE = KernelConfig(tile=64, stages=1, new_after_loop=True, merge_heads=4)
ENGINE_CONFIGS = (PIPELINED, ONE_STAGE)  # every configuration `kernel_config` picks but the next
# a decode step over an e4m3 cache (its own K/V stored): both products on float16 operands, the
# tiles widened exactly and the scales applied after them, in two stages at every batch size
FP8_DECODE_STEP = dataclasses.replace(PIPELINED, f16_products=True)


def engine_configs(kv_fp8: bool = False, store_new: bool = True) -> tuple[KernelConfig, ...]:
    """Every configuration `kernel_config` picks for a launch of this kind (GPU tests run each)."""
    return (FP8_DECODE_STEP,) if kv_fp8 and store_new else ENGINE_CONFIGS


def register_capped(configs: Sequence[KernelConfig], most: int = 128) -> list[KernelConfig]:
    """Each of `configs` held to `most` registers a thread (four 4-warp programs resident on sm_90
    where the compiler's choice holds three)."""
    return [dataclasses.replace(c, max_registers=most) for c in configs]


def product_variants(configs: Sequence[KernelConfig]) -> list[KernelConfig]:
    """Each of `configs` with P.V, Q.K^T and both taking e4m3 operands, and with both taking float16
    ones (an e4m3 cache's variants, which the sweeps and tests run beside the configuration as it is)."""
    return [dataclasses.replace(c, pv_fp8=pv, qk_fp8=qk, f16_products=f16) for c in configs
            for pv, qk, f16 in ((True, False, False), (False, True, False), (True, True, False),
                                (False, False, True))]


def kernel_config(batch: int, kv_fp8: bool = False, store_new: bool = True) -> KernelConfig:
    """The configuration for a step of `batch` sequences: fixed per captured graph. Two pipeline
    stages, but one from 9 to 63 sequences, where one stage measured faster at 32 x 1,024, and over
    an e4m3 cache (`kv_fp8`) below 64 sequences, where it also measured faster at 4 and 8 long
    contexts; a decode step over an e4m3 cache (`store_new`: it stores its own K/V) takes
    FP8_DECODE_STEP, 9-15% faster than the dequantizing kernel at 8 x 16,384, 32 x 1,024 and
    256 x 256, where the cache-only launch of a mixed step's decode rows measured slower with it
    (bench/profile_gpu.py --attention and --attention-grid; docs/benchmarks.md,
    docs/quantization.md)."""
    if kv_fp8 and store_new:
        return FP8_DECODE_STEP
    return ONE_STAGE if batch < 64 and (kv_fp8 or batch > 8) else PIPELINED
