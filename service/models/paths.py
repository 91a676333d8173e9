"""Where a model's files are, without loading anything (no torch): the directory a GGUF model is
converted into, and where its tokenizer will be found."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..cache_dirs import default_cache_dir
from .default_model import default_gguf_path


def _gguf_cache_key(gguf: Path) -> str:
    st = gguf.stat()
    return hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def converted_path(gguf: Path, cache_dir: Path) -> Path:
    """Where the loader keeps `gguf` converted to a safetensors directory."""
    return cache_dir / f"{gguf.stem}-{_gguf_cache_key(gguf)}"


def model_files_dir(source: str | None, cache_dir: Path | None) -> Path | None:
    """The directory the loader reads `source` (None: the embedded default) from, if it is there
    already: the given directory, or the one a GGUF model was converted into (not yet: None). A
    front loads the tokenizer from it while the engine loads the weights; the supervisor reads the
    weights ahead from it."""
    cache_dir = cache_dir or default_cache_dir()
    given = Path(source) if source else None
    if given is None or (given.is_file() and given.suffix == ".gguf"):
        target = converted_path(default_gguf_path() if given is None else given, cache_dir)
        return target if (target / "config.json").is_file() else None
    return given if given.is_dir() else None
