"""Programmatic dependent launch (PDL: compute capability 9.0 on, CUDA graphs included). A kernel
launched with it is scheduled while the kernel before it still drains, and waits for that kernel's
writes (`griddepcontrol.wait`) before it reads or writes anything, so the gaps between a step's
many small kernels shrink. The engine's own Triton kernels (their `PDL` constexpr: the CPU's
interpreter has no such instruction) and Inductor's generated ones (`triton.enable_pdl`) use it
together, process-wide, once a core is built with `programmatic_launch` on a GPU that has it.

Each of the engine's kernels waits first thing, then lets its successor launch: a kernel's
completion implies its predecessor's, so the order of the stream holds along the whole chain.
"""

from __future__ import annotations

import torch

_enabled = False
_inductor_before: bool | None = None  # Inductor's own choice, restored when turned off again


def supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def enable(on: bool) -> None:
    """Launch the engine's kernels (and compile Inductor's) with PDL or without, from now on."""
    global _enabled, _inductor_before
    from torch._inductor import config

    if on != _enabled and hasattr(config.triton, "enable_pdl"):
        if on:
            _inductor_before = config.triton.enable_pdl
        config.triton.enable_pdl = True if on else bool(_inductor_before)
    _enabled = on


def enabled() -> bool:
    return _enabled
