"""The library's import graph: no cycle (module-level or inside functions), and nothing below the backend imports it.

Read from the source with ``ast``, so a lazy import inside a function counts as much as one at the top of a file.
``from pkg import sub`` counts as an import of the submodule ``sub``, not of ``pkg``'s ``__init__`` as well.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"tilecompile": "tilecompile", "tilecompile.passes": "passes", "tilecompile.kernels": "kernels"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{module}.{alias.name}" for alias in node.names} & mods.keys()
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(module)
    return (found & mods.keys()) - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_scan_sees_the_library():
    graph = _graph()
    assert {"tilecompile.backend", "tilecompile.passes.lm_head.rewrite", "tilecompile.kernels.fused_linear_ce"} <= set(
        graph
    )
    assert "tilecompile.pipeline" in graph["tilecompile.backend"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_only_the_ddp_lowering_imports_the_backend():
    importers = sorted(name for name, deps in _graph().items() if "tilecompile.backend" in deps)
    assert importers == ["tilecompile.integrations.ddp"]
