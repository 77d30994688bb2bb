"""Building and loading one request's :class:`PoolBackedKVCache` layers."""

from __future__ import annotations

from mlx_lm.models import cache as _mlx_cache

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.memory.kv_arena import KVArena
from veloxquant_mlx.memory.leases import LayerGroup
from veloxquant_mlx.memory.pool_backed import PoolBackedKVCache
from veloxquant_mlx.memory.pool_kv_common import require_plain_kv_model
from veloxquant_mlx.memory.request_blocks import RequestBlocks


def build_pooled_caches(
    model, pool: BlockPoolAllocator, owner: int, step: int | None = None, *,
    storage: KVArena | None = None,
) -> list[PoolBackedKVCache]:
    """One :class:`PoolBackedKVCache` per layer of ``model``, sharing one owner.

    The drop-in replacement for ``mlx_lm.models.cache.make_prompt_cache(model)``.
    Calling ``release()`` on any returned cache frees the blocks of all of them.

    Args:
        model: An mlx-lm model (anything with ``layers``).
        pool: Shared pool.
        owner: The request's id.
        step: Accounting growth chunk; defaults to ``pool.config.block_size``.
        storage: The pool's block storage: the caches then view one block table
            of the request in it (what the server builds for each request, and
            what :func:`~veloxquant_mlx.memory.request_blocks.make_batch_caches`
            batches); None keeps each layer's KV in a contiguous buffer.

    Returns:
        ``len(model.layers)`` caches.

    Raises:
        ValueError: If the model's own ``make_cache()`` asks for a cache other
            than a plain ``KVCache`` for some layer (sliding-window, SSM, ...);
            the message names the first such layer and its cache type; or
            ``storage`` is another pool's, or laid out for another layer count.
    """
    require_plain_kv_model(model, "PoolBackedKVCache",
                           "use mlx_lm's make_prompt_cache(model) for this model")
    layers = len(model.layers)
    if storage is None:
        return _as_layers([PoolBackedKVCache(pool, owner, step) for _ in range(layers)])
    if storage.pool is not pool or storage.layout.n_layers != layers:
        raise ValueError(f"storage is laid out for {storage.layout.n_layers} layers of "
                         f"{'this' if storage.pool is pool else 'another'} pool; the model "
                         f"has {layers} layers")
    return caches_over(storage, owner, step)


def caches_over(storage: KVArena, owner: int, step: int | None = None
                ) -> list[PoolBackedKVCache]:
    """One request's caches over ``storage``, one per layer it was laid out for.

    What the server's runner builds for each request: the model was checked when it
    loaded and the storage was laid out from it (:func:`build_pooled_caches` checks both
    for a caller that has only a model).
    """
    blocks = RequestBlocks(storage, owner)
    return _as_layers([PoolBackedKVCache.over_storage(blocks, i, step)
                       for i in range(storage.layout.n_layers)])


def _as_layers(caches: list[PoolBackedKVCache]) -> list[PoolBackedKVCache]:
    """Mark ``caches`` as one model's layers, in order (see ``LayerGroup``)."""
    group = LayerGroup(caches)
    for cache in caches:
        cache._layers = group
    return caches


def load_pooled_prompt_cache(
    file_name: str,
    pool: BlockPoolAllocator,
    owner: int,
    step: int | None = None,
    return_metadata: bool = False,
):
    """Load a saved prompt cache and account its tokens in ``pool`` under ``owner``.

    Accepts files saved from :class:`PoolBackedKVCache` lists and from stock
    ``KVCache`` lists alike; either way the result is attached pool-backed caches.

    Args:
        file_name: A ``.safetensors`` file written by ``save_prompt_cache``.
        pool: Pool to account the loaded tokens in.
        owner: The request id the blocks are checked out to.
        step: Accounting growth chunk; defaults to ``pool.config.block_size``.
        return_metadata: Also return the file's metadata dict.

    Returns:
        The caches, or ``(caches, metadata)`` when ``return_metadata``.

    Raises:
        ValueError: If a layer's saved cache is neither kind (the layer is named).
        BlockPoolExhaustedError: If the pool cannot hold the loaded tokens;
            nothing stays allocated in that case.
    """
    loaded, metadata = _mlx_cache.load_prompt_cache(file_name, return_metadata=True)
    caches = []
    for index, cache in enumerate(loaded):
        if type(cache) is _mlx_cache.KVCache:
            cache = PoolBackedKVCache.from_state(cache.state)
        elif not isinstance(cache, PoolBackedKVCache):
            raise ValueError(
                f"layer {index} of {file_name} holds a {type(cache).__name__}, not a KVCache; "
                "load it with mlx_lm's load_prompt_cache instead"
            )
        caches.append(cache)
    try:
        for cache in caches:
            cache.attach(pool, owner, step)
    except BaseException:
        if caches and caches[0]._lease is not None:
            caches[0].release()
        raise
    _as_layers(caches)
    return (caches, metadata) if return_metadata else caches
