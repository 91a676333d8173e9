"""The engine's custom ops that write the KV cache, dispatched without autograd's version bumps.

`torch.library.custom_op` gives an op that mutates its arguments a Python kernel at the dispatcher's
ADInplaceOrView key: before every call it binds the op's arguments to its schema and bumps the
mutated tensors' version counters, which autograd reads to refuse a backward through a tensor changed
since it was saved. The engine runs inference only, where nothing reads them, and that kernel is
most of the op's dispatch cost, paid once a layer in every step the CUDA graphs do not replay (the
steps with prompts: docs/architecture.md). So the key falls through, straight to the op's own kernel.
A PyTorch whose `Library.impl` refuses to override a kernel registered from Python (before it took
`allow_override`: the GPU images' 2.11) gets the fall-through from the library's dispatcher handle
itself, which that check does not guard; where even that fails, the op keeps custom_op's kernel: the
same results, the bump's cost.
"""

from __future__ import annotations

import warnings

import torch

_LIBRARY = torch.library.Library("tandem", "FRAGMENT")
SKIPPED: list[str] = []  # the ops dispatched past the bump, by qualified name


def without_version_bumps(qualified_name: str) -> bool:
    """Dispatch the custom op `namespace::name` past ADInplaceOrView (its mutated arguments' version
    counters are left as they are); False where this PyTorch keeps custom_op's kernel."""
    namespace, name = qualified_name.split("::")
    if namespace != "tandem":
        raise ValueError(f"{qualified_name}: only the engine's own ops (tandem::) are changed here")
    with warnings.catch_warnings():  # overriding the kernel custom_op registered is the point
        warnings.simplefilter("ignore", UserWarning)
        try:
            _LIBRARY.impl(name, torch.library.fallthrough_kernel, "ADInplaceOrView")
        except RuntimeError:  # "already a kernel registered from python": an older PyTorch
            handle = getattr(_LIBRARY, "m", None)
            try:
                handle.impl(name, "ADInplaceOrView", torch.library.fallthrough_kernel, False)
            except (AttributeError, RuntimeError, TypeError):
                return False
    if qualified_name not in SKIPPED:
        SKIPPED.append(qualified_name)
    return True
