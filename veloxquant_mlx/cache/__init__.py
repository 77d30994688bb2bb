"""KV-cache compression methods behind one ``KVCache`` interface.

``KVCacheBuilder().with_method(name)...build()`` returns a cache for one
attention head; see :mod:`veloxquant_mlx.cache.base` for shapes and
:class:`KVCacheFactory` for the registered methods.
"""

from veloxquant_mlx.cache.base import STANDALONE_METHODS, KVCache
from veloxquant_mlx.cache.builder import KVCacheBuilder, KVCacheConfig, KVCacheFactory
from veloxquant_mlx.cache.kivi import KIVICache
from veloxquant_mlx.cache.polar import PolarQuantCache
from veloxquant_mlx.cache.qjl import QJLCache
from veloxquant_mlx.cache.spectral import SpectralCache
from veloxquant_mlx.cache.turboquant import TurboQuantMSECache, TurboQuantProdCache

__all__ = [
    "STANDALONE_METHODS",
    "KIVICache",
    "KVCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "PolarQuantCache",
    "QJLCache",
    "SpectralCache",
    "TurboQuantMSECache",
    "TurboQuantProdCache",
]
