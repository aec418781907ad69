"""Imports point one way: kernels <- engine <- web <- bench (the `trillm` dispatcher names bench modules by path);
inside web, the shared layers (chat, service, http) below the API surfaces."""

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
WEB = "trillm.web"
SURFACES = tuple(f"{WEB}.{s}" for s in ("openai", "anthropic", "responses", "ws", "router", "playground", "app"))
SERVERS = ("quart", "quart_trio", "hypercorn", "werkzeug")
# web/ folder -> what it must never import
WEB_FORBIDDEN = {
    "chat": (*SERVERS, *SURFACES, f"{WEB}.http", f"{WEB}.service"),
    "service": (*SERVERS, *SURFACES, f"{WEB}.http", f"{WEB}.chat"),
    "http": SURFACES,
    "anthropic": (f"{WEB}.responses",),
    "responses": (f"{WEB}.anthropic",),
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


@pytest.mark.parametrize("folder", sorted(WEB_FORBIDDEN))
def test_web_layers(folder: str) -> None:
    forbidden = WEB_FORBIDDEN[folder]
    bad = [f"{path.relative_to(ROOT)} imports {name}" for path in sorted((ROOT / "web" / folder).rglob("*.py"))
           for name in _imports(path) if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not bad, "\n".join(bad)


def test_only_the_server_builds_the_app() -> None:
    allowed = {ROOT / "web" / "server.py", ROOT / "web" / "app.py"}
    bad = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "web").rglob("*.py"))
           if path not in allowed and f"{WEB}.app" in _imports(path)]
    assert not bad, bad
