"""The shape of the house, read from the code's own imports: no import cycle anywhere (service,
operator, CLI and benchmarks), the engine's math (engine/ops/) never imports the control code around
it, the fronts and the supervisor import nothing of the engine, and the contract between the processes
imports no torch.

Imports are read with `ast`, module level and inside functions alike (a cycle through a lazy import
is still a cycle of concepts), except for what a process loads: the supervisor's entry points
(runtime/entry.py) import each child's code inside that child. Imports under `if TYPE_CHECKING:` are
annotations only and not counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# import name -> folder, as pyproject.toml's package-dir maps them
PACKAGES = {
    "tandem.service": REPO / "service",
    "tandem.operator": REPO / "operator",
    "tandem.bench": REPO / "bench",
    "tandem": REPO / "tandem",
}
GENERATED = ("_pb2.py", "_pb2_grpc.py")


def _modules() -> dict[str, Path]:
    """Every module of the distribution's own code: import name -> file."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if path.name.endswith(GENERATED):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            found.setdefault(name, path)  # tandem.service.x is service/'s, never tandem/'s
    return found


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _function_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path], loaded_only: bool = False) -> set[str]:
    """The modules of ours that `name` imports (`loaded_only`: those importing it loads, not those
    its functions import when they run)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree) | (_function_lines(tree) if loaded_only else set())
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in modules:  # `from pkg import name`: the module, or pkg
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """What importing each module loads."""
    modules = _modules()
    return {name: _imports(name, path, modules, loaded_only=True) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_reads_real_imports(graph):
    """The walk sees the arrows it must judge: a test that found none would pass on anything."""
    assert "tandem.service.contract" in graph["tandem.service.server.engine_client"]
    assert "tandem.service.engine.scheduler" in graph["tandem.service.engine.engine_core"]
    assert "tandem.bench.engine.harness" in graph["tandem.bench.workloads.timed_run"]
    annotation_only = "tandem.service.server.request_stream"
    assert annotation_only not in graph["tandem.service.telemetry.requests"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle(graph):
    assert _cycles(graph) == []


def test_the_engines_math_imports_nothing_of_the_control_code(graph):
    """engine/ops/ (kernels, attention, the cache) and engine/ (scheduler, runner, loop) point one way."""
    ops = [m for m in graph if m.startswith("tandem.service.engine.ops")]
    assert "tandem.service.engine.ops.triton_decode" in ops
    for name in ops:
        outside = {m for m in graph[name] if not m.startswith("tandem.service.engine.ops")}
        assert not outside, f"{name} imports {outside}"


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


FRONT_SIDE = ["tandem.service.server", "tandem.service.telemetry", "tandem.service.contract"]


@pytest.mark.parametrize("side", FRONT_SIDE)
def test_the_fronts_import_nothing_of_the_engine(graph, side):
    """Every record they share with the engine is the contract's (service/contract.py)."""
    starts = [m for m in graph if m == side or m.startswith(side + ".")]
    assert starts
    for start in starts:
        engine = sorted(m for m in _reach(graph, start) if m.startswith("tandem.service.engine"))
        assert not engine, f"{start} reaches {engine}"


def test_the_supervisor_loads_nothing_of_the_engine_or_the_fronts(loaded):
    reached = _reach(loaded, "tandem.service.runtime.supervisor")
    assert "tandem.service.runtime.entry" in reached  # its children's entry points, loaded lazily there
    children = ("tandem.service.engine", "tandem.service.server.front")
    assert not sorted(m for m in reached if m.startswith(children))


def test_the_contract_imports_no_torch():
    code = "import sys, tandem.service.contract; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "False"
