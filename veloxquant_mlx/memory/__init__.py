"""Block-pool memory for KV caches: bookkeeping (no MLX) and MLX-backed pieces."""

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
from veloxquant_mlx.memory.pool_backed import (
    PoolBackedKVCache,
    build_pooled_caches,
    load_pooled_prompt_cache,
)
from veloxquant_mlx.memory.pooled import PooledKVCache
from veloxquant_mlx.memory.storage import MLXBlockStorage

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
