"""No import circle inside trillm.engine or trillm.kernels: every import counts, at module level, under
TYPE_CHECKING or inside a function (a lazy import still ties the two modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["trillm", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _edges(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (`from pkg import sub` names sub, not pkg)."""
    paths = {_module(p): p for p in (ROOT / package).rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".")[: len(mod.split(".")) - node.level + (path.name == "__init__.py")]
                    base = ".".join(here + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in paths]
                names += subs if len(subs) == len(node.names) else [base, *subs]
        graph[mod] = {m for n in names if (m := known(n)) is not None and m != mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the path around it; None if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        state[mod] = 2
        path.pop()
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)) is not None:
            return found
    return None


def test_the_finder_sees_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("package", ["engine", "kernels"])
def test_no_import_circle(package: str) -> None:
    graph = _edges(package)
    assert len(graph) > 10 and any(graph.values()), "the import graph came out empty"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
