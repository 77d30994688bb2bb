"""Fixtures of the GGUF converter tests: synthetic files and the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf import synth
from veloxquant_mlx.gguf import GGUFError, convert_gguf, smollm2_gguf_path


@pytest.fixture(scope="session")
def synthetic_files(tmp_path_factory) -> dict[str, Path]:
    """One small GGUF file per variant of :data:`synth.VARIANTS` (~1 s in all)."""
    folder = tmp_path_factory.mktemp("gguf-synthetic")
    return {
        name: synth.write_model(folder / f"tiny-{name}.gguf", spec)
        for name, spec in synth.VARIANTS.items()
    }


@pytest.fixture(scope="session")
def synthetic_converted(synthetic_files, tmp_path_factory) -> dict[str, Path]:
    """The synthetic files converted into one shared cache root."""
    root = tmp_path_factory.mktemp("gguf-cache")
    return {name: convert_gguf(path, root) for name, path in synthetic_files.items()}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 file (skips if the wheel is absent)."""
    try:
        return smollm2_gguf_path()
    except GGUFError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2 converted once for the whole session (under a second)."""
    return convert_gguf(smollm2_path, tmp_path_factory.mktemp("gguf-smollm2"))


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_folder):
    """``(model, tokenizer)`` of the converted SmolLM2, via mlx_lm.load."""
    import mlx_lm

    return mlx_lm.load(str(smollm2_folder))
