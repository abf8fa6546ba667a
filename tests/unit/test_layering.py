"""The tree's layering: ``common/`` is Ray-free, and every package of ``common/`` and ``services/`` imports only from
its own package or from the layers below it — type-checking imports included — with no import cycle anywhere."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.paths import ROOT

LAYERS: list[tuple[str, ...]] = [
    ("common.errors", "common.fair", "common.native_build"),
    ("common.stop", "common.config"),
    ("common.auth", "common.obs"),
    ("common.grammar",),
    ("common.tools",),
    ("common.protocol",),
    ("common.model",),
    ("common.cache", "common.kv", "common.media"),
    ("common.admission", "common.grammar.compiler"),
    ("common.sched",),
    ("common.stages",),
    ("common.engine", "common.reference"),
    ("common.batch",),
    ("services.proto", "services.platform"),
    ("services.routers",),
    ("services.stages",),
    ("services.ingress",),
    ("services.batch",),
    ("services.app", "services.cli"),
]
"""Bottom first. A module may import its own unit (the longest name here that prefixes it) and the units of lower
layers; units that share a layer never import each other."""


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("common", "services"):
        for path in (ROOT / top).rglob("*.py"):
            if path.parent == ROOT / top and path.name == "__init__.py":
                continue  # (the top-level packages' own, empty modules: in no layer)
            out[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module ``name`` imports, wherever the import statement is (functions and ``TYPE_CHECKING``
    blocks included); ``from pkg import sub`` counts the submodule."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _unit(module: str) -> tuple[str, int]:
    best = max(
        ((u, i) for i, layer in enumerate(LAYERS) for u in layer if module == u or module.startswith(u + ".")),
        key=lambda x: len(x[0]),
        default=None,
    )
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_every_import_goes_down_the_layers():
    upward = []
    for module, targets in _graph().items():
        unit, layer = _unit(module)
        for target in targets:
            other, other_layer = _unit(target)
            if other != unit and other_layer >= layer:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not go down the layers:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

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
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    """The two checks above can fail: a module of a lower layer importing a higher one is found, in a
    ``TYPE_CHECKING`` block too, and so is a cycle."""
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from common.engine import x\n"
    )
    known = {"common.protocol.a": tmp_path / "a.py", "common.engine": tmp_path / "e.py"}
    targets = _imports("common.protocol.a", tmp_path / "a.py", known)
    assert targets == {"common.engine"} and _unit("common.engine")[1] > _unit("common.protocol.a")[1]
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


def test_common_never_imports_ray():
    modules = sorted(m for m in _modules() if m.split(".")[0] == "common")
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]\nprint(len(bad))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0"
    assert len(modules) > 15


def test_layers_name_every_package():
    """A new package of ``common/`` gets a place in the layer order (it would otherwise fall into no unit)."""
    for module in _modules():
        _unit(module)
    units = defaultdict(list)
    for i, layer in enumerate(LAYERS):
        for u in layer:
            units[u].append(i)
    assert all(len(v) == 1 for v in units.values()), "a unit is listed twice"


NOT_SERVING = ("common/obs/dashboards.py", "services/cli.py", "services/batch/", "common/batch/", "services/proto/")
"""Code that no request runs through: the dashboard generator, the command line, the offline batch job, generated
stubs."""

MAX_FUNCTION_LINES = 50


def test_no_function_on_the_serving_path_is_over_50_lines():
    long = []
    for path in _modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(NOT_SERVING):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions to split by responsibility:\n" + "\n".join(long)
