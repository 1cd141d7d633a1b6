"""The package runs one way: public API -> validation -> plan -> launch -> kernels. Read from the source with ast
(nothing is imported): no import cycle anywhere; kernels/ imports nothing above it but the backend switch; no
module outside tools/ imports tools/ (the command line aside)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "flashnumba"


def _modules():
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name, path, modules):
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                prefix = ".".join(parts + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t in modules and t != name and t != "flashnumba":
                found.add(t)
                break
    return found


def _graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_no_import_cycles():
    graph = _graph()
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_kernels_import_nothing_above_them():
    for m, deps in _graph().items():
        if m.startswith("flashnumba.kernels"):
            above = {d for d in deps if not d.startswith("flashnumba.kernels") and d != "flashnumba._backend"}
            assert not above, f"{m} imports {sorted(above)}"


def test_only_the_command_line_imports_the_tools():
    for m, deps in _graph().items():
        if not m.startswith("flashnumba.tools") and m != "flashnumba.__main__":
            tools = {d for d in deps if d.startswith("flashnumba.tools")}
            assert not tools, f"{m} imports {sorted(tools)}"


def test_layers_run_one_way():
    order = ["flashnumba.api", "flashnumba._validate", "flashnumba.planner", "flashnumba.tiling",
             "flashnumba._launch", "flashnumba._cache"]
    graph = _graph()
    for i, m in enumerate(order):
        for upper in order[:i]:
            assert upper not in graph[m], f"{m} imports {upper}, a layer above it"
