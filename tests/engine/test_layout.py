"""The engine/HTTP split holds: the engine package knows nothing of HTTP."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "server" / "engine"
HTTP_MODULES = ("fastapi", "starlette", "uvicorn", "server.http")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_engine_imports_nothing_from_the_http_side():
    files = sorted(ENGINE.glob("*.py"))
    assert files
    for path in files:
        bad = {n for n in _imports(path) if n.startswith(HTTP_MODULES)}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_http_side_reaches_the_engine_through_its_protocol_only():
    http = ENGINE.parent / "http"
    allowed = {"server.engine.engine"}  # the app builds the engine; records: server.protocol
    for path in sorted(http.rglob("*.py")):
        used = {n for n in _imports(path) if n.startswith("server.engine")}
        assert used <= allowed, f"{path.relative_to(http)} imports {sorted(used - allowed)}"
