"""How many variants of the engine's own Triton kernels have been compiled in this process.

Triton compiles a kernel again for each new class of its arguments (constexprs, a 1 or a multiple
of 16 among its integers, pointer alignment); one compiled while serving is a step that waited for
the compiler. Tests check that serving compiles none; benchmarks report any that a timed run did.
"""

from __future__ import annotations


def compiled_variants() -> int:
    """Variants of the decode, merge and K/V-write kernels and of the FP8 GEMM and quantization
    kernels compiled so far, over every device."""
    from .triton_decode import _decode_split_kernel, _merge_kernel
    from .triton_fp8_gemm import _fp8_gemm_kernel
    from .triton_fp8_gemm_swapped import _fp8_gemm_swapped_kernel
    from .triton_kv_write import _write_step_kv_kernel
    from .triton_silu_mul_quant import _silu_mul_quant_kernel

    kernels = (_decode_split_kernel, _merge_kernel, _write_step_kv_kernel, _fp8_gemm_kernel,
               _fp8_gemm_swapped_kernel, _silu_mul_quant_kernel)
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())
