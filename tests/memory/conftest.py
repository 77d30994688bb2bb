"""Fixtures of the memory tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model(tiny_model):
    """The tiny mlx-lm model (loaded once; the tests read it, none changes it)."""
    return tiny_model[0]
