"""The engine's layering: the math (service/engine/ops/) never imports the control code around
it, and the engine's modules import each other without a cycle (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "service" / "engine"


def _imports(path: Path) -> set[str]:
    """Engine modules `path` imports (relative imports, resolved to names under engine/)."""
    package = path.parent.relative_to(ENGINE).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            if node.level - 1 > len(package):
                continue  # above the engine (service.*): not an engine module
            target = (*base, *(node.module.split(".") if node.module else ()))
            if node.module is None:  # `from . import x, y`
                found |= {".".join((*target, alias.name)) for alias in node.names}
            else:
                found.add(".".join(target))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {".".join(p.relative_to(ENGINE).with_suffix("").parts): p for p in ENGINE.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): p for name, p in modules.items()}
    return {name: {m for m in _imports(p) if m in modules} for name, p in modules.items()}


def test_the_ops_import_nothing_of_the_control_code():
    graph = _graph()
    ops = [name for name in graph if name.startswith("ops.") or name == "ops"]
    assert "ops.mixed_op" in ops and "ops.triton_decode" in ops
    for name in ops:
        outside = {m for m in graph[name] if not (m.startswith("ops.") or m == "ops")}
        assert not outside, f"{name} imports the control code: {outside}"


def test_the_engine_modules_import_each_other_without_a_cycle():
    graph = _graph()
    assert graph["model_runner"] >= {"batch", "step_buffers", "forward"}  # the walk sees real imports
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, name, dep])}"
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
