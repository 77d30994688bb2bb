"""Where an optimized BLAS and the forward in front of it are, found without loading them.

:func:`~veloxquant_mlx.cpu_backend.load_optimized_blas` tries these candidates in order and
:mod:`~veloxquant_mlx.blas_status` names the one missing when none serves MLX. Looking only
(no ``dlopen``, no import of the wheel) keeps this safe to call in any process, before or
after MLX is imported. The environment variables read here are documented with the rest
in :mod:`veloxquant_mlx.cpu_backend`.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OPT_OUT_ENV = "VELOXQUANT_NO_BLAS_PRELOAD"
CHOICE_ENV = "VELOXQUANT_BLAS_LIBRARY"
FORWARD_STEM = "_sgemv_forward"
# The PyPI wheel of OpenBLAS with 32-bit integers, every symbol prefixed with "scipy_".
WHEEL_MODULE = "scipy_openblas32"
WHEEL_PREFIX = "scipy_"

# Distribution OpenBLAS builds, best first. Debian's ``libblas.so.3`` under
# ``openblas-pthread`` is OpenBLAS exporting the plain BLAS/CBLAS names MLX calls.
_CANDIDATES = (
    "/usr/lib/{triplet}/openblas-pthread/libblas.so.3",
    "/usr/lib/{triplet}/openblas-openmp/libblas.so.3",
    "/usr/lib/{triplet}/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True, slots=True)
class BlasLibrary:
    """An optimized BLAS to load under MLX.

    Attributes:
        path: The shared library.
        prefix: What its CBLAS names start with: ``"scipy_"`` for the wheel's, ``""`` for a
            distribution's (``cblas_sgemm``).
    """

    path: Path
    prefix: str = ""

    def symbol(self, name: str) -> str:
        """This library's name for the CBLAS function ``name`` (e.g. ``cblas_sgemm``)."""
        return self.prefix + name


def wheel_blas() -> BlasLibrary | None:
    """The ``scipy-openblas32`` wheel's OpenBLAS, found without importing the wheel.

    Importing ``scipy_openblas32`` loads its library as a side effect; this only looks.

    Returns:
        The library, or None when the wheel is not installed (one this user may not read
        is returned: loading it says why it cannot be used).
    """
    try:
        spec = importlib.util.find_spec(WHEEL_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            found = sorted((Path(folder) / "lib").glob("libscipy_openblas*.so*"))
        except OSError:
            continue
        if found:
            return BlasLibrary(found[0], WHEEL_PREFIX)
    return None


def system_blas(patterns: Sequence[str] = _CANDIDATES) -> BlasLibrary | None:
    """The first distribution OpenBLAS there (``scripts/install_blas.sh`` installs one).

    Args:
        patterns: Where to look, best first; ``{triplet}`` is e.g. ``x86_64-linux-gnu``.

    Returns:
        The library, or None when none is installed. One this user may not read (or may
        not even look for) is returned too: loading it then says why it cannot be used.
    """
    triplet = f"{platform.machine()}-linux-gnu"
    for pattern in patterns:
        path = Path(pattern.format(triplet=triplet))
        try:
            if path.is_file():
                return BlasLibrary(path)
        except PermissionError:  # a folder on the way that this user may not search
            return BlasLibrary(path)
    return None


def find_sgemv_forward() -> Path | None:
    """Return the built forward library (see :mod:`veloxquant_mlx.cpu_backend`), if any.

    Returns:
        ``veloxquant_mlx/_sgemv_forward*.so``; None off Linux or when the install did not
        build it (no C compiler).
    """
    if sys.platform != "linux":
        return None
    built = sorted(Path(__file__).resolve().parent.glob(f"{FORWARD_STEM}*.so"))
    return built[0] if built else None


def blas_candidates(with_forward: bool) -> list[BlasLibrary]:
    """The optimized BLAS libraries to try, best first (Linux).

    Args:
        with_forward: Whether the forward is there to put in front: the wheel's prefixed
            names serve MLX only through it.
    """
    if sys.platform != "linux":
        return []
    chosen = os.environ.get(CHOICE_ENV, "")
    if chosen:
        path = Path(chosen)
        prefix = WHEEL_PREFIX if path.name.startswith("lib" + WHEEL_PREFIX) else ""
        return [BlasLibrary(path, prefix)] if with_forward or not prefix else []
    found = [wheel_blas() if with_forward else None, system_blas()]
    return [lib for lib in found if lib is not None]


def find_optimized_blas() -> Path | None:
    """The library :func:`~veloxquant_mlx.cpu_backend.load_optimized_blas` tries first,
    without loading it."""
    candidates = blas_candidates(find_sgemv_forward() is not None)
    return candidates[0].path if candidates else None


def preload_opted_out(enabled: bool) -> bool:
    """Whether no optimized BLAS is wanted: the ``cpu.optimized_blas`` setting is off,
    or ``VELOXQUANT_NO_BLAS_PRELOAD`` says so for the whole process."""
    return not enabled or os.environ.get(OPT_OUT_ENV, "") not in ("", "0")
