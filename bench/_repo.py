"""Make `tandem`, `tandem.service` and `tandem.operator` importable from this checkout without installing it.

The repository root is deliberately NOT put on sys.path: its operator/ folder would shadow the
stdlib `operator` module. Instead, `tandem` and `tandem.service` are registered as packages whose
__path__ points at tandem/ and service/, so `tandem.service.engine.*` resolves to service/engine/.
Import this module (`import _repo`) before anything from tandem; bench/ is on sys.path when a
script in it runs as `python bench/x.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _package(name: str, folder: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def install() -> None:
    if "tandem.service" in sys.modules:
        return
    _package("tandem", REPO / "tandem")
    _package("tandem.service", REPO / "service")
    sys.modules["tandem"].service = sys.modules["tandem.service"]
    _package("tandem.operator", REPO / "operator")
    sys.modules["tandem"].operator = sys.modules["tandem.operator"]


install()
