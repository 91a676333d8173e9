"""`--inductor NAME=VALUE`: a benchmark run with one of Inductor's choices changed process-wide
(`torch._inductor.config`), so that a code-generation choice is measured, end to end, before the
engine makes it: e.g. `split_reductions=False`, a reduction over a long row in one kernel rather
than a partial and a final one (a decode step's few rows), or `triton.enable_pdl=True`, each kernel
launched while the one before it drains (programmatic dependent launch, Hopper on). The run's result
records what it set.
"""

from __future__ import annotations

import argparse
import ast


def add_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE",
                    help="set torch._inductor.config.NAME to VALUE (a Python literal) for this run; "
                         "repeatable; recorded in the result")


def apply(pairs: list[str]) -> dict[str, object]:
    """Set each NAME=VALUE of `pairs` in torch._inductor.config -> what was set. An unknown name or a
    value that is not a Python literal raises ValueError."""
    from torch._inductor import config

    chosen: dict[str, object] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--inductor {pair!r}: expected NAME=VALUE")
        *path, leaf = name.split(".")
        owner = config
        for part in path:  # a nested group such as `triton`
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, leaf):
            raise ValueError(f"--inductor {pair!r}: torch._inductor.config has no {name!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"--inductor {pair!r}: {text!r} is not a Python literal") from exc
        setattr(owner, leaf, value)
        chosen[name] = value
    return chosen
