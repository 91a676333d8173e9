"""`python -m tandem.bench NAME [ARGS]`: `tandem bench NAME [ARGS]` without the CLI (neither its
settings nor gRPC imported), so that the engine's benchmarks run on a GPU host with only torch and
transformers. From a source checkout that is not installed, `python bench NAME [ARGS]` does the
same: run as a folder, this maps the checkout's packages (tandem/, service/, operator/, bench/ as
`tandem`, `tandem.service`, `tandem.operator`, `tandem.bench`) without putting the repository root
on sys.path, whose operator/ folder would shadow the standard library's `operator`.
"""

import argparse
import importlib.util
import sys
from pathlib import Path


def _map_checkout() -> None:
    """Register the checkout's folders as the packages they are installed as."""
    root = Path(__file__).resolve().parent.parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root / "bench"]
    for name, folder in (("tandem", "tandem"), ("tandem.service", "service"), ("tandem.operator", "operator"),
                         ("tandem.bench", "bench")):
        spec = importlib.util.spec_from_file_location(
            name, root / folder / "__init__.py", submodule_search_locations=[str(root / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


if not __package__ and "tandem.bench" not in sys.modules:  # `python bench`, and its spawned children
    _map_checkout()

from tandem.bench import BENCHMARKS, run  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tandem.bench", description=__doc__)
    ap.add_argument("name", choices=sorted(BENCHMARKS))
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    sys.exit(run(args.name, args.bench_args))
