"""VeloxQuant-MLX: block-pool KV-cache memory and KV compression for MLX."""

__version__ = "0.1.0"

__all__ = ["KVCacheBuilder", "KVCacheConfig", "KVCacheFactory", "__version__"]

_CACHE_EXPORTS = ("KVCacheBuilder", "KVCacheConfig", "KVCacheFactory")


def __getattr__(name: str) -> object:
    # Lazy (PEP 562): importing the package must not pull in MLX, so the pure
    # Python block-pool bookkeeping stays importable and testable without it.
    if name in _CACHE_EXPORTS:
        from veloxquant_mlx.cache import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'veloxquant_mlx' has no attribute {name!r}")
