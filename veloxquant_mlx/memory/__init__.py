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

__all__ = [
    "AllocationStats",
    "Block",
    "BlockPoolAllocator",
    "BlockPoolExhaustedError",
    "ForeignBlockError",
    "OwnerAlreadyActiveError",
    "PoolArgumentError",
    "PoolArgumentTypeError",
    "PoolConfig",
    "VeloxQuantError",
]
