"""The one error type of the GGUF converter."""

from __future__ import annotations

from pathlib import Path

from veloxquant_mlx.exceptions import VeloxQuantError


class GGUFError(VeloxQuantError, ValueError):
    """A GGUF file cannot be read or converted.

    The message is a single line that names the file and the problem, because
    it usually ends up in a server log or an HTTP error body.

    Attributes:
        path: The GGUF file concerned.
        problem: What is wrong with it, without the file name.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"GGUF file {str(path)!r}: {problem}")
