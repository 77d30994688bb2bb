"""Fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest

# The live-server fixtures and helpers (tests.support.servers) serve tests/engine,
# tests/http, tests/e2e and tests/server alike.
pytest_plugins = ["tests.support.servers"]


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Folder of the offline ``tiny`` model, built on first use (a few seconds).

    It lives in the git-ignored ``models/`` folder at the repository root, so
    later runs (and a server started meanwhile) reuse it.
    """
    from veloxquant_mlx.offline_model import ensure_model

    return ensure_model("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: Path):
    """``(model, tokenizer)`` of the tiny model, loaded once with ``mlx_lm.load``."""
    import mlx_lm

    return mlx_lm.load(str(tiny_model_path))
