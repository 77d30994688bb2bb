"""Prefix cache figures and no-op eviction, checked exactly.

``published_blocks`` (shown by ``/admin/pool``) counts the pool blocks taken
into the cache, so it grows by the blocks of each position published and not
at all when the position was cached already. An eviction that needs no block
on any stream frees nothing, however many entries are evictable.

One "layer" (a k and a v stream) and block_size 4: every position is two
pool blocks.
"""

from __future__ import annotations

from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.prefix_cache import PrefixCache, chain_hashes, prefix_root

BS = 4
ROOT = prefix_root("model-a", "fp32", BS)


def _cache() -> tuple[BlockPoolAllocator, PrefixCache]:
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=24))
    return pool, pool.prefix_cache


def _publish(pool: BlockPoolAllocator, cache: PrefixCache, owner: int,
             keys: list[bytes]) -> list[bool]:
    """``owner`` writes one position per key and publishes each."""
    k = pool.allocate("k", len(keys) * BS, owner)
    v = pool.allocate("v", len(keys) * BS, owner)
    return [cache.publish(owner, key, [k[j], v[j]]) for j, key in enumerate(keys)]


def test_published_blocks_grows_by_the_pool_blocks_taken_and_not_for_a_duplicate():
    pool, cache = _cache()
    keys = chain_hashes(list(range(3 * BS)), BS, ROOT)
    assert _publish(pool, cache, 1, keys[:2]) == [True, True]
    assert cache.view()["published_blocks"] == 4  # 2 positions x (k + v)
    assert _publish(pool, cache, 2, keys) == [False, False, True]  # 2 cached already
    assert cache.view()["published_blocks"] == 6
    assert cache.counters.published_blocks == cache.cached_blocks == 6


def test_evicting_for_no_blocks_frees_nothing():
    pool, cache = _cache()
    keys = chain_hashes(list(range(2 * BS)), BS, ROOT)
    _publish(pool, cache, 1, keys)
    cache.release(1)  # both positions are evictable now
    before = cache.view()
    assert before["evictable_blocks"] == 4
    assert cache.evict({"k": 0, "v": 0}) == 0
    assert cache.evict({}) == 0
    assert cache.view() == before
    assert len(cache.match(keys)) == 2
