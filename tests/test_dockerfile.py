"""Dockerfile.dev stays consistent with the repository (no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile.dev"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_every_copied_path_exists():
    for word, rest in instructions():
        if word == "COPY":
            *sources, _dest = rest.split()
            for src in sources:
                if src != ".":
                    assert (ROOT / src).exists(), f"Dockerfile.dev copies missing {src}"


def test_installs_the_project_and_runs_make_test_by_default():
    ins = instructions()
    assert ins[0][0] == "FROM" and "python:3" in ins[0][1] and "slim" in ins[0][1]
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert "libopenblas0-pthread" in runs and "make install" in runs
    assert ("CMD", '["make", "test"]') in ins
    assert re.search(r"^install:", (ROOT / "Makefile").read_text(), re.M)
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(), re.M)


def test_dockerignore_keeps_local_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".venv", "models", ".git"):
        assert path in ignored
