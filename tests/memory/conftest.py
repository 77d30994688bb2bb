"""Fixtures of the memory tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model(tiny_model):
    """The tiny mlx-lm model (loaded once; the tests read it, none changes it)."""
    return tiny_model[0]


@pytest.fixture(scope="session")
def served_model(tiny_model):
    """The tiny model as the server runs it: the project's Llama-shaped forward pass
    over the same weights (:mod:`veloxquant_mlx.llama_model`)."""
    from veloxquant_mlx.llama_model import own_model

    return own_model(tiny_model[0])
