"""Where the server keeps what it makes once and reuses: converted models, and the compiler's
artefacts (`cache_dir`, default $XDG_CACHE_HOME/tandem; /cache in a pod).

The compiler's artefacts are torch.compile's (Inductor's FX-graph and AOTAutograd caches) and
Triton's compiled kernels, under `<cache_dir>/compile/torch-<version>-triton-<version>/`: a restart,
or another pod given the same directory, finds the kernels compiled before and skips compiling
them. Their own keys hold what a kernel was compiled for (the graph, its shapes and dtypes, the
GPU, the CUDA and compiler versions), so a different model, shape set or GPU never loads another's;
the versions in the directory's name keep artefacts of one torch apart from another's, and make
old ones easy to delete. Nothing here imports torch: the environment is set before it is loaded.
"""

from __future__ import annotations

import os
import tempfile
import time
from importlib import metadata
from pathlib import Path

# the engine process's exit status when its start-up failed while reading compiled artefacts: the
# supervisor starts it once more, the artefacts set aside (torch may crash on a corrupt one)
COMPILE_CACHE_UNUSABLE_EXIT = 75  # EX_TEMPFAIL


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def compile_cache_dir(cache_dir: Path | None) -> Path:
    """The compiler's artefacts for the installed torch and Triton, under `cache_dir`."""
    versions = f"torch-{_version('torch')}-triton-{_version('triton')}".replace("+", "_")
    return (cache_dir or default_cache_dir()) / "compile" / versions


def use_compile_cache(cache_dir: Path | None) -> tuple[Path | None, str]:
    """Point torch.compile's and Triton's caches at `compile_cache_dir` (where the environment has not
    named them already) if it is writable. -> (the directory, what to log), or (None, why not): the
    compiler then keeps its defaults (a temporary directory)."""
    root = compile_cache_dir(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root):  # mkdir succeeds on a read-only mount that has it
            pass
    except OSError as exc:
        return None, f"compiled artefacts are not kept: {root} is not writable ({exc.strerror or exc})"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return root, f"compiled artefacts kept in {root}"


def set_aside(root: Path) -> Path | None:
    """Move `root` out of the way (to `<root>.unusable-<time>`, for a look and then deletion): the next
    start finds no artefacts and compiles afresh. -> where it went, None if it could not be moved."""
    aside = root.with_name(f"{root.name}.unusable-{int(time.time())}")
    try:
        root.rename(aside)
    except OSError:
        return None
    return aside
