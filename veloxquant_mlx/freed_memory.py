"""Give memory freed while the model is prepared back to the system.

Loading, repacking and stacking weights allocate new buffers and free the old ones. MLX
keeps freed buffers in its cache, and what goes back to glibc stays in the process's heap
until a trim: on a 1B model the stacked q/k/v and gate/up weights
(:mod:`veloxquant_mlx.fused_projections`) left ~270 MiB resident that no array used.
Serving does the same on a smaller scale: a step's transients (prompt activations, the
codes kernel's int8 rows) go back to MLX's cache and glibc's heap, and the server gives
them back each time it falls idle (``server.engine.steps``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (musl, macOS). Looked up once: ``find_library``
    runs a subprocess."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def release_freed_memory() -> None:
    """Empty MLX's buffer cache, then hand glibc's free heap back (no-op elsewhere)."""
    import mlx.core as mx

    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
