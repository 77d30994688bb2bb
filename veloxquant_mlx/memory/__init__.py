"""Block-pool memory for KV caches.

The bookkeeping half (``PoolConfig``, ``Block``, ``AllocationStats``,
``BlockPoolAllocator``) is plain Python and imports without MLX. The
MLX-backed pieces load on first use, so ``import veloxquant_mlx.memory``
works in a process (or on a machine) that has no MLX.
"""

from importlib import import_module

from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    ForeignBlockError,
    OwnerAlreadyActiveError,
    PoolArgumentError,
    PoolArgumentTypeError,
    VeloxQuantError,
)
from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    PoolConfig,
)

# name -> module that defines it; imported lazily because they need MLX.
_MLX_EXPORTS = {
    "PoolBackedKVCache": "pool_backed",
    "build_pooled_caches": "pool_backed",
    "load_pooled_prompt_cache": "pool_backed",
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
    "ForeignBlockError",
    "MLXBlockStorage",
    "OwnerAlreadyActiveError",
    "PoolArgumentError",
    "PoolArgumentTypeError",
    "PoolBackedKVCache",
    "PoolConfig",
    "PooledKVCache",
    "VeloxQuantError",
    "build_pooled_caches",
    "load_pooled_prompt_cache",
]
