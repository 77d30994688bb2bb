"""Block-pool memory for KV caches.

``PooledKVCache`` wraps one of VeloxQuant's own compressing caches
(``veloxquant_mlx.cache``) and only accounts its appends in the pool, while
``PoolBackedKVCache`` is a drop-in for mlx-lm's plain ``KVCache`` (pass it to
``mlx_lm.generate``) that keeps uncompressed keys and values and draws its
growth from the pool; given the pool's block storage it keeps them in the
pool's blocks, and ``make_batch_caches`` batches such requests.

The bookkeeping half (``PoolConfig``, ``Block``, ``AllocationStats``,
``BlockPoolAllocator``) is plain Python and imports without MLX. The
MLX-backed pieces load on first use, so ``import veloxquant_mlx.memory``
works in a process (or on a machine) that has no MLX.
"""

import hashlib
import importlib.util
import os
import sys
import warnings
from importlib import import_module
from pathlib import Path


def _load_allocator_source_if_needed() -> None:
    """Use the pure-Python allocator when the compiled one is unwanted or stale.

    ``pip install`` may compile records.py and block_pool.py with mypyc (see
    setup.py); an extension module shadows its .py. If the source was edited
    after the build, the extension would run old code, so the source is
    loaded instead (with a warning). VELOXQUANT_PURE_PYTHON=1 forces it.
    """
    here = Path(__file__).parent
    names = ("records", "free_stacks", "block_pool")  # in import order
    stale = [ext.name for name in names for ext in here.glob(f"{name}.*.so")
             if _built_from_other_source(ext, here / f"{name}.py")]
    if stale:
        warnings.warn(
            f"compiled allocator {stale} was built from another version of its source; "
            "using the source (reinstall the package to rebuild it: `make install` in a "
            "checkout)",
            stacklevel=2,
        )
    elif not os.environ.get("VELOXQUANT_PURE_PYTHON"):
        return
    for name in names:
        full = f"{__name__}.{name}"
        spec = importlib.util.spec_from_file_location(full, here / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)


def _built_from_other_source(ext: Path, source: Path) -> bool:
    """Whether compiled module ``ext`` was built from another text than ``source`` now.

    The build writes the source's SHA-256 beside it (setup.py's SOURCE_STAMP); a
    build without one is judged by file times, which pip does not keep for a wheel.
    """
    stamp = ext.parent / f"{source.stem}.source-sha256"
    try:
        built_from = stamp.read_text().strip()
    except OSError:
        return ext.stat().st_mtime < source.stat().st_mtime
    return built_from != hashlib.sha256(source.read_bytes()).hexdigest()


_load_allocator_source_if_needed()

from veloxquant_mlx.exceptions import (  # noqa: E402 (after the loader above)
    BlockPoolExhaustedError,
    CacheReleasedError,
    ForeignBlockError,
    OwnerAlreadyActiveError,
    PoolArgumentError,
    PoolArgumentTypeError,
    VeloxQuantError,
)
from veloxquant_mlx.memory.block_pool import (  # noqa: E402
    AllocationStats,
    Block,
    BlockPoolAllocator,
    PoolConfig,
)

NATIVE_ALLOCATOR = not sys.modules[f"{__name__}.block_pool"].__file__.endswith(".py")

# name -> module that defines it; imported lazily because they need MLX.
_MLX_EXPORTS = {
    "PoolBackedKVCache": "pool_backed",
    "make_batch_caches": "request_blocks",
    "build_pooled_caches": "pooled_caches",
    "load_pooled_prompt_cache": "pooled_caches",
    "PooledKVCache": "pooled",
    "MLXBlockStorage": "storage",
}


def __getattr__(name: str):
    module = _MLX_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


__all__ = [
    "AllocationStats",
    "Block",
    "BlockPoolAllocator",
    "BlockPoolExhaustedError",
    "CacheReleasedError",
    "ForeignBlockError",
    "MLXBlockStorage",
    "NATIVE_ALLOCATOR",
    "OwnerAlreadyActiveError",
    "PoolArgumentError",
    "PoolArgumentTypeError",
    "PoolBackedKVCache",
    "PoolConfig",
    "PooledKVCache",
    "VeloxQuantError",
    "build_pooled_caches",
    "load_pooled_prompt_cache",
    "make_batch_caches",
]
