"""How many variants of the engine's own Triton kernels have been compiled in this process.

Triton compiles a kernel again for each new class of its arguments (constexprs, a 1 or a multiple
of 16 among its integers, pointer alignment); one compiled while serving is a step that waited for
the compiler. Tests check that serving compiles none; benchmarks report any that a timed run did.
"""

from __future__ import annotations


def compiled_variants() -> int:
    """Variants of the decode, merge and K/V-write kernels compiled so far, over every device."""
    from .triton_decode import _decode_split_kernel, _merge_kernel
    from .triton_kv_write import _write_step_kv_kernel

    kernels = (_decode_split_kernel, _merge_kernel, _write_step_kv_kernel)
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())
