"""PooledKVCache: block-granular pool accounting around the compressed caches."""

from __future__ import annotations

import numpy as np
import pytest

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.exceptions import BlockPoolExhaustedError, OwnerAlreadyActiveError
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig, PooledKVCache

HEAD_DIM = 64


def _inner(method: str = "turboquant_mse", bits: int | None = None):
    builder = KVCacheBuilder().with_method(method).with_head_dim(HEAD_DIM)
    if bits is not None:
        builder = builder.with_bits(bits)
    return builder.with_residual_length(32).with_calibration_tokens(32).build()


def _kv(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, HEAD_DIM)).astype(np.float32),
            rng.standard_normal((n, HEAD_DIM)).astype(np.float32))


def _used(cache: PooledKVCache, stream: str) -> list[int]:
    return [block.n_used for block in cache.blocks(stream)]


def test_blocks_are_checked_out_per_block_never_per_token() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    cache = PooledKVCache(_inner(), pool, owner=1)
    keys, values = _kv(20)
    for t in range(15):
        cache.append(keys[t], values[t])
    # 15 tokens fit one block per stream: 2 allocations in all, not 30.
    assert pool.stats.n_allocations == 2
    assert (_used(cache, "k"), _used(cache, "v")) == ([15], [15])
    cache.append(keys[15], values[15])
    assert pool.stats.n_allocations == 2 and _used(cache, "k") == [16]
    cache.append(keys[16], values[16])
    assert pool.stats.n_allocations == 4
    assert (_used(cache, "k"), _used(cache, "v")) == ([16, 1], [16, 1])
    assert cache.n_blocks_held() == 4
    assert pool.blocks_for(1) == cache.blocks("k")[:1] + cache.blocks("v")[:1] + \
        cache.blocks("k")[1:] + cache.blocks("v")[1:]
    assert {b.stream for b in cache.blocks("k")} == {"k"}
    assert {b.stream for b in cache.blocks("v")} == {"v"}


def test_chunk_appends_take_all_needed_blocks_at_once_and_fill_the_last() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=16))
    cache = PooledKVCache(_inner(), pool, owner=2)
    keys, values = _kv(60)
    cache.append_key(keys[:40])
    assert _used(cache, "k") == [16, 16, 8] and cache.blocks("v") == []
    assert pool.stats.n_allocations == 3
    cache.append_key(keys[40:50])
    assert _used(cache, "k") == [16, 16, 16, 2]
    cache.append_value(values[:50])
    assert _used(cache, "v") == [16, 16, 16, 2]
    assert sum(_used(cache, "k")) == cache.n_keys == 50
    # Fragmentation counts each stream's partial last block: 2 of 16 blocks.
    assert pool.stats.fragmentation() == pytest.approx(2 / 16)


def test_one_pool_hosts_several_formats_side_by_side() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=64))
    specs = [("kivi", 2), ("turboquant_mse", 3), ("turboquant_prod", 4), ("qjl", 2),
             ("polar", 4), ("spectral", 4)]
    caches = []
    for i, (method, bits) in enumerate(specs):
        cache = PooledKVCache(_inner(method, bits), pool, owner=10 + i)
        keys, values = _kv(5 + 9 * i, seed=i)
        cache.append(keys, values)
        caches.append(cache)
    assert [c.format for c in caches] == ["int2", "tq3", "tqp4", "qjl2", "polar4", "svd4"]
    for cache in caches:
        held = pool.blocks_for(cache.owner)
        assert len(held) == cache.n_blocks_held() == 2 * -(-len(cache) // 16)
        assert {(b.format, b.owner) for b in held} == {(cache.format, cache.owner)}
    assert pool.stats.blocks_in_use() == sum(c.n_blocks_held() for c in caches)
    # Freed blocks of one format are reused by a cache of another.
    freed_ids = {b.block_id for b in pool.blocks_for(caches[0].owner)}
    caches[0].release()
    assert pool.blocks_for(caches[0].owner) == []
    reused_before = pool.stats.n_reused
    newcomer = PooledKVCache(_inner("polar", 3), pool, owner=99)
    newcomer.append(*_kv(16))
    assert pool.stats.n_reused - reused_before == 2
    assert {b.block_id for b in pool.blocks_for(99)} <= freed_ids
    assert {b.format for b in pool.blocks_for(99)} == {"polar3"}
    for cache in caches[1:] + [newcomer]:
        cache.release()
    assert pool.stats.blocks_in_use() == 0 and pool.stats.fragmentation() == 0.0


def test_explicit_format_tag_wins_over_the_inner_format() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    cache = PooledKVCache(_inner("kivi"), pool, owner=3, format="int2-kivi")
    cache.append(*_kv(3))
    assert cache.format == "int2-kivi"
    assert {b.format for b in pool.blocks_for(3)} == {"int2-kivi"}


def test_release_is_idempotent_and_ends_the_cache() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    cache = PooledKVCache(_inner(), pool, owner=4)
    keys, values = _kv(20)
    cache.append(keys, values)
    before = np.array(cache.attend(keys[0]))
    cache.release()
    cache.release()
    assert cache.released and cache.n_blocks_held() == 0
    assert pool.stats.blocks_in_use() == 0 and pool.n_free("k") == 4
    np.testing.assert_array_equal(np.array(cache.attend(keys[0])), before)
    with pytest.raises(ValueError, match="was released"):
        cache.append(keys[:1], values[:1])
    # The owner id is free again for the next request.
    PooledKVCache(_inner(), pool, owner=4).append(keys[:1], values[:1])


def test_exhaustion_leaves_the_inner_cache_and_pool_unchanged() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4))  # 2 per stream
    cache = PooledKVCache(_inner(), pool, owner=5)
    keys, values = _kv(48)
    cache.append_key(keys[:20])
    with pytest.raises(BlockPoolExhaustedError) as info:
        cache.append_key(keys[20:48])
    # 12 of the 28 rows fit the partial block; the other 16 need one more block.
    assert (info.value.stream, info.value.requested, info.value.free) == ("k", 1, 0)
    assert cache.n_keys == 20 and _used(cache, "k") == [16, 4]
    assert pool.stats.blocks_in_use() == 2 and pool.stats.n_exhausted == 1
    cache.append_key(keys[20:32])  # still fits the partial block
    assert _used(cache, "k") == [16, 16]


def test_duplicate_owner_is_rejected() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    PooledKVCache(_inner(), pool, owner=6)
    with pytest.raises(OwnerAlreadyActiveError):
        PooledKVCache(_inner(), pool, owner=6)


def test_wrapper_delegates_attention_and_memory() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    inner = _inner("turboquant_prod", 3)
    cache = PooledKVCache(inner, pool, owner=7)
    keys, values = _kv(30)
    cache.append(keys, values)
    assert len(cache) == len(inner) == 30
    assert cache.memory_bytes() == inner.memory_bytes()
    np.testing.assert_array_equal(
        np.array(cache.attend(keys[:2])), np.array(inner.attend(keys[:2]))
    )


def test_shared_stream_pool() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=6, separate_kv=False))
    cache = PooledKVCache(_inner(), pool, owner=8)
    cache.append(*_kv(17))
    assert cache.n_blocks_held() == 4 and pool.n_free("kv") == 2
    assert {b.stream for b in pool.blocks_for(8)} == {"kv"}


def test_inner_must_be_a_veloxquant_cache() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    with pytest.raises(TypeError, match="KVCacheBuilder"):
        PooledKVCache(object(), pool, owner=9)  # type: ignore[arg-type]


def test_spec_usage_example_runs() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=512))
    inner = KVCacheBuilder().with_method("kivi").with_head_dim(128).build()
    cache = PooledKVCache(inner, pool, owner=42, format="int2")
    rng = np.random.default_rng(0)
    for _ in range(40):
        cache.append(rng.standard_normal(128), rng.standard_normal(128))
    assert pool.stats.blocks_in_use() == 6
    cache.release()
    assert pool.stats.blocks_in_use() == 0
