"""Where VeloxQuant writes files of its own (built and downloaded models).

Never inside the installed package or the source tree: site-packages may be
read-only or shared between users, and a checkout should stay clean. The
root is ``VELOXQUANT_HOME`` when set, else the user's cache folder
(``~/.cache/veloxquant-mlx`` on Linux, ``~/Library/Caches/veloxquant-mlx``
on macOS).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

HOME_ENV = "VELOXQUANT_HOME"
APP_NAME = "veloxquant-mlx"


def home_dir() -> Path:
    """The root of everything VeloxQuant writes (not created here)."""
    configured = os.environ.get(HOME_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(platformdirs.user_cache_dir(APP_NAME))


def models_dir() -> Path:
    """Folder holding built and downloaded models: ``home_dir() / "models"``.

    Read on every call, so a changed ``VELOXQUANT_HOME`` takes effect at once.
    """
    return home_dir() / "models"
