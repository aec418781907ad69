"""Imports point one way: kernels <- engine <- web <- bench (the `trillm` dispatcher names bench modules by path)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> what it must never import
FORBIDDEN = {
    "kernels": ("trillm.engine", "trillm.web", "trillm.bench", "trio", "quart", "quart_trio", "hypercorn", "anyio"),
    "engine": ("trillm.web", "trillm.bench", "trio", "quart", "quart_trio", "hypercorn", "anyio"),
    "web": ("trillm.bench",),
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
