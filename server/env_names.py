"""Checks on ``VELOXQUANT_*`` environment variables: typos and secrets.

:mod:`server.settings` reads the environment; this module only judges the
names and values it finds there, so that a mistake stops start-up with a
message naming the variable instead of being ignored:

- a ``VELOXQUANT_*`` name that maps to no setting, no secret and none of the
  variables other parts of the project read (:data:`NON_SETTING_ENV`) is a
  typo: the message names the closest valid name;
- a secret (API key, admin token) is stripped of surrounding whitespace (a
  file-mounted secret usually ends with a newline) and must then be
  non-empty printable ASCII, the only bytes an HTTP header carries
  unambiguously.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# VELOXQUANT_* variables that are not settings, and who reads them. A test greps the
# code base for VELOXQUANT_ names and fails on any that is neither a setting nor listed here.
NON_SETTING_ENV: dict[str, str] = {
    "VELOXQUANT_HOME": "models cache folder (veloxquant_mlx/paths.py)",
    "VELOXQUANT_NO_BLAS_PRELOAD": "load no optimized BLAS under MLX; it keeps its bundled one "
                                  "(veloxquant_mlx/cpu_backend.py)",
    "VELOXQUANT_BLAS_LIBRARY": "the one OpenBLAS to load under MLX instead of looking "
                               "(veloxquant_mlx/cpu_backend.py)",
    "VELOXQUANT_NO_SGEMV_FORWARD": "the BLAS forward only passes calls on: no one-row sgemv "
                                   "or prompt kernels (veloxquant_mlx/cpu_backend.py)",
    "VELOXQUANT_KERNEL_CACHE": "where the native MLX operations are built and cached "
                               "(veloxquant_mlx/kernels/build.py)",
    "VELOXQUANT_PURE_PYTHON": "use the pure-Python allocator (setup.py, "
                              "veloxquant_mlx/memory/__init__.py)",
    "VELOXQUANT_QMM_THREADS": "threads for products from quantized codes "
                              "(veloxquant_mlx/kernels/codes_kernel.c)",
}


class EnvError(ValueError):
    """A ``VELOXQUANT_*`` variable is misspelt or holds an unusable secret."""


def unknown_variable(name: str, valid: Iterable[str]) -> EnvError:
    """The error for a ``VELOXQUANT_*`` variable that maps to nothing.

    Args:
        name: The variable as found in the environment.
        valid: Every name the server (or the project) reads.
    """
    close = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else (
        "see the default config for the settings: config/default.toml in the source, "
        "server/default_config/default.toml where installed")
    return EnvError(f"environment variable {name} is not a setting of this server ({hint}); "
                    "fix or unset it (VELOXQUANT_<SECTION>_<KEY> sets key <key> of "
                    "[<section>] in the default config)")


def clean_secret(name: str, raw: str) -> str:
    """The secret in ``raw`` without surrounding whitespace.

    Args:
        name: The variable it came from (named in the error).
        raw: Its value.

    Raises:
        EnvError: Empty after stripping, or not printable ASCII.
    """
    value = raw.strip()
    if not value:
        raise EnvError(f"{name} is set but empty; unset it to turn the check off, or set a "
                       "non-empty token")
    if not (value.isascii() and value.isprintable()):
        raise EnvError(f"{name} holds non-ASCII or control characters, which HTTP clients "
                       "cannot send reliably in an Authorization header; use printable "
                       "ASCII only (e.g. `openssl rand -hex 32`)")
    return value
