"""What every group of benchmarks shares: the model shapes, the percentile they all report, the
markdown table they print, and the one-line refusal of a benchmark whose needs are missing.

Imports nothing but the standard library, so that argument parsing and client processes stay light.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Sequence

# Llama shapes of the benchmarks (random-initialised weights)
SHAPES = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = q / 100 * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def refuse(benchmark: str, needs: str) -> None:
    """End the benchmark with one line on stderr (exit status 1): what it needs that is missing."""
    sys.exit(f"tandem bench {benchmark} {needs}")


def need_modules(benchmark: str, *modules: str, why: str = "") -> None:
    """Refuse unless every module imports (found, not imported): `pip install` names the missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        refuse(benchmark, f"needs {', '.join(missing)}{why}: pip install {' '.join(missing)}")


def need_cuda(benchmark: str, what: str = "") -> None:
    """Refuse unless a CUDA device is visible to torch."""
    import torch

    if not torch.cuda.is_available():
        refuse(benchmark, f"needs a CUDA device{what} (torch sees none)")
