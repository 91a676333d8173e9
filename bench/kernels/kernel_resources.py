"""`tandem bench kernel-resources`: the decode kernel's registers, shared memory and occupancy,
compiled for a GPU that need not be here.

Triton compiles for a named target without a device (its bundled ptxas); cuobjdump reads the
registers and stack of the cubin. So on any host with Triton this reports, for each kernel
configuration the sweeps time (`decode_grid.KernelConfig`) and each way a step launches the
kernel (a merge or none; the step's own K/V written, rotated), what one program holds and how many
programs one multiprocessor keeps resident: the K/V reads it can have in flight. The arguments are
typed and aligned as the engine launches them on the 8B shape (bf16, 4 query heads per KV head,
head_dim 128, 16-token blocks). `--kv-cache-dtype fp8`: over an e4m3 cache, the engine's
configurations with and without their products taking e4m3 (`pv_fp8`, `qk_fp8`) or float16
(`f16_products`) operands.

    tandem bench kernel-resources [--arch 90] [--kv-cache-dtype auto|fp8] [--out PATH] [--sass DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.common import markdown_table, need_modules
from tandem.bench.record import ResultFile, machine, versions
from tandem.service.engine.ops.decode_grid import (
    ENGINE_CONFIGS,
    FP8_DECODE_STEP,
    SPLIT_TOKENS,
    KernelConfig,
    product_variants,
    register_capped,
)

# what the multiprocessors of sm_90 (H100, H200) hold: registers, threads, shared memory, programs
SM90 = {"registers": 65536, "threads": 2048, "shared": 233472, "programs": 32}
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
SHARED_RESERVED = 1024  # bytes of shared memory the hardware keeps per program

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32", "lens_ptr": "*i32",
            "new_k_ptr": "*bf16", "new_v_ptr": "*bf16", "slot_ptr": "*i64", "inv_freq_ptr": "*fp32",
            # a bf16 cache has no scales: the launch passes the context lengths in their place
            "k_scale_ptr": "*i32", "v_scale_ptr": "*i32",
            "part_out_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16"}
FLOATS = {"scale": "fp32", "rope_scaling": "fp32"}
# integers the launch does not specialise on 16-divisibility (RUN_TIME_ARGS, or not multiples of 16)
UNALIGNED = {"least_splits", "num_splits", "stride_tb", "stride_mb", "stride_mh", "stride_ms",
             "k_scale_ptr", "v_scale_ptr"}  # and the pointers not specialised on (SPLIT_RUN_TIME_ARGS)
# an e4m3 cache: its K/V and its layer's scales
FP8_POINTERS = {**POINTERS, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32",
                "v_scale_ptr": "*fp32"}


@dataclass(frozen=True)
class Launch:
    """How a step launches the split kernel: one split (no merge), the step's own K/V, rotated."""

    direct: bool
    store_new: bool
    rotary: bool


LAUNCHES = {"decode step, one split": Launch(True, True, True),
            "decode step, with a merge": Launch(False, True, True),
            "mixed step's decode rows": Launch(False, False, False)}


def launch_name(launch: Launch) -> str:
    return "decode_direct" if launch.direct else ("decode_merge" if launch.store_new else "mixed_rows")


@dataclass(frozen=True)
class Resources:
    registers: int
    stack: int
    shared: int
    warps: int

    def resident(self, sm: dict = SM90) -> int:
        """Programs one multiprocessor holds at once."""
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        limits = [sm["programs"], sm["threads"] // (32 * self.warps),
                  sm["registers"] // (per_warp * self.warps)]
        if self.shared:
            limits.append(sm["shared"] // (self.shared + SHARED_RESERVED))
        return min(limits)


def cuobjdump() -> str:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else (shutil.which("cuobjdump") or "cuobjdump")


def compiled(config: KernelConfig, launch: Launch, arch: int, sass: Path | None = None,
             kv_fp8: bool = False) -> Resources:
    """The split kernel compiled for sm_`arch` as a step launches it, without a device; its
    machine code written to `sass` where given. `kv_fp8`: over an e4m3 cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tandem.service.engine.ops.triton_decode import _decode_split_kernel as kernel

    constexprs = dict(DIRECT=launch.direct, SPLIT_TOKENS=SPLIT_TOKENS, GROUP=4, GROUP_PAD=16, HEAD_DIM=128,
                      BLOCK_SIZE=16, TILE=config.tile, STORE_NEW=launch.store_new, ROTARY=launch.rotary,
                      DOT_PRECISION="tf32", OFFSET_I64=False, NEW_AFTER_LOOP=config.new_after_loop,
                      SINGLE_SPLIT_DIRECT=config.single_split_direct, KV_FP8=kv_fp8,
                      PV_FP8=config.pv_fp8, QK_FP8=config.qk_fp8,
                      F16_PRODUCTS=config.f16_products)
    pointers = FP8_POINTERS if kv_fp8 else POINTERS
    signature = {name: "constexpr" if name in constexprs else pointers.get(name) or FLOATS.get(name) or "i32"
                 for name in kernel.arg_names}
    aligned = [name for name, kind in signature.items()
               if (kind.startswith("*") or kind == "i32") and name not in UNALIGNED]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    binary = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options=config.launch_options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump(), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
        if sass is not None:
            sass.write_text(subprocess.run([cuobjdump(), "-sass", cubin.name], capture_output=True, text=True,
                                           check=True).stdout)
    return Resources(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                     stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                     shared=binary.metadata.shared, warps=config.warps)


CONFIGS = [KernelConfig(tile, stages, 4, new_after_loop=after)
           for after in (False, True) for tile in (32, 64) for stages in (1, 2, 3)] + [
    # a one-split sequence's output from its program: only a launch with a merge differs
    KernelConfig(tile, stages, 4, new_after_loop=after, single_split_direct=True)
    for tile, stages, after in ((64, 1, False), (32, 1, False), (64, 2, True), (32, 2, True))]
# over an e4m3 cache: the engine's configurations, and each with P.V, Q.K^T and both on e4m3 operands
# and with both on float16 ones; the decode step's held to 128 registers
FP8_CONFIGS = [*ENGINE_CONFIGS, *product_variants(ENGINE_CONFIGS), *register_capped([FP8_DECODE_STEP])]


def sass_path(folder: str | None, config: KernelConfig, launch: Launch) -> Path | None:
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    stem = (f"tile{config.tile}_stages{config.stages}_after{config.new_after_loop:d}"
            f"_direct{config.single_split_direct:d}_pv{config.pv_fp8:d}_qk{config.qk_fp8:d}"
            f"_f16{config.f16_products:d}_maxreg{config.max_registers or 0}_{launch_name(launch)}")
    return Path(folder) / f"{stem}.sass"


def report_rows(arch: int, sass: str | None, kv_fp8: bool = False) -> list[dict]:
    """Each configuration compiled as each launch runs it (those that compile to the same kernel once)."""
    rows = []
    for config in FP8_CONFIGS if kv_fp8 else CONFIGS:
        for name, launch in LAUNCHES.items():
            if not launch.store_new and config.new_after_loop:
                continue  # the same kernel as without: nothing comes after the loop
            if launch.direct and config.single_split_direct:
                continue  # the same kernel as without: every sequence has one split
            r = compiled(config, launch, arch, sass_path(sass, config, launch), kv_fp8)
            rows.append({**dataclasses.asdict(config), "products": config.products, "launch": name,
                         **dataclasses.asdict(r), "resident_per_sm": r.resident()})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="tandem bench kernel-resources", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100, H200)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/<date>_cpu_kernel-resources_sm<arch>.json)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="the cache the kernel reads: the model's dtype (bf16) or e4m3")
    ap.add_argument("--sass", default=None, metavar="DIR",
                    help="also write each configuration's machine code (cuobjdump -sass) to DIR")
    a = ap.parse_args(argv)
    need_modules("kernel-resources", "triton", why=" (it compiles with Triton; no GPU needed)")
    kv_fp8 = a.kv_cache_dtype == "fp8"
    shape = f"sm{a.arch}-kv-fp8" if kv_fp8 else f"sm{a.arch}"
    result_file = ResultFile("kernel-resources", argv, "cpu", shape, a.out)
    rows = report_rows(a.arch, a.sass, kv_fp8)
    print(markdown_table(
        ["tile", "stages", "warps", "new after loop", "one split direct", "products", "max registers",
         "launch", "registers", "shared KiB", "resident per SM"],
        [[r["tile"], r["stages"], r["warps"], r["new_after_loop"], r["single_split_direct"], r["products"],
          r["max_registers"] or "-", r["launch"],
          r["registers"], round(r["shared"] / 1024, 1), r["resident_per_sm"]] for r in rows]))
    env = {**machine(), **versions("torch", "triton"), "compiled_for": f"sm_{a.arch}",
           "kv_cache_dtype": a.kv_cache_dtype}
    print(f"wrote {result_file.write({'benchmark': 'kernel_resources', 'environment': env, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
