"""MLX settings a long-running server needs, read by MLX from the environment.

MLX's CUDA backend keeps what it builds per shape or graph topology in LRU caches: the
CUDA graphs a step is launched as (``MLX_CUDA_GRAPH_CACHE_SIZE``), cuDNN's attention plans
for prompts (one per exact query/key shape, ``MLX_CUDA_SDPA_CACHE_SIZE``), and others. Each
cache carries a "thrashing check" that counts its misses over the whole life of the process,
never resetting them, and once they pass twice the cache's capacity it throws on every new
entry (MLX 0.32, ``mlx/backend/cuda/lru_cache.h``). A server meets new prompt lengths, batch
sizes and step graphs for as long as it runs, so the check is a fuse, not a rate: after a
few hundred distinct prompt shapes every new one fails its request, and a throw from a graph
commit leaves the stream's command encoder broken for every later call until the process
restarts (ml-explore/mlx#4326). With the check off the caches still evict their least
recently used entries: a shape seen again after eviction is built again, slower, and
served.

:func:`apply_mlx_env_defaults` sets these before MLX is imported (MLX reads them when it
creates a stream); a value the operator exported is kept. The CPU and Metal backends read
none of them.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MLX_ENV_DEFAULTS: dict[str, str] = {
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
}


def apply_mlx_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every :data:`MLX_ENV_DEFAULTS` entry that ``environ`` does not already have.

    Call it first thing in an entry point, before ``mlx`` is imported.

    Args:
        environ: The environment to change (``os.environ`` when None).

    Returns:
        The entries it set (the operator's own values are left alone and not listed).
    """
    environ = os.environ if environ is None else environ
    applied = {name: value for name, value in MLX_ENV_DEFAULTS.items() if name not in environ}
    environ.update(applied)
    return applied
