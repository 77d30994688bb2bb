"""The library used on its own, without the server: the edges a direct caller meets.

A step that runs out of blocks part-way through a request's layers, another
pool's block read through a storage, caches dropped without ``release()``,
Prometheus counts, and typed errors the compiled and pure allocators share.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import mlx.core as mx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    CacheReleasedError,
    ForeignBlockError,
    PoolArgumentTypeError,
)
from veloxquant_mlx.memory import (
    BlockPoolAllocator,
    MLXBlockStorage,
    PoolBackedKVCache,
    PoolConfig,
    PooledKVCache,
    build_pooled_caches,
    leases,
)

BS, LAYERS = 4, 3
MODEL = SimpleNamespace(layers=[None] * LAYERS)  # all build_pooled_caches reads of a model


def kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k_key, v_key = mx.random.split(mx.random.key(seed))
    return (mx.random.normal((1, 2, n, 8), key=k_key), mx.random.normal((1, 2, n, 8), key=v_key))


def test_a_step_that_runs_out_in_a_later_layer_leaves_every_layer_where_it_began():
    # Per stream: 3 layers x 2 blocks (8 tokens) + 1 spare block, so the 9th token
    # fits layer 0 only.
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=2 * (LAYERS * 2 + 1)))
    caches = build_pooled_caches(MODEL, pool, owner=1)
    prompt = [kv(8, seed) for seed in range(LAYERS)]
    for cache, (k, v) in zip(caches, prompt, strict=True):
        cache.update_and_fetch(k, v)
    step = kv(1, 99)
    caches[0].update_and_fetch(*step)  # takes the spare block
    with pytest.raises(BlockPoolExhaustedError):
        caches[1].update_and_fetch(*step)
    # Layer 0 gave its token and its new blocks back: the request is consistent.
    assert [c.offset for c in caches] == [8] * LAYERS
    assert [c.n_blocks_held() for c in caches] == [4] * LAYERS
    assert pool.n_free("k") == pool.n_free("v") == 1
    # Room made (another owner's blocks would be freed here), the same step reruns.
    for cache in caches:
        cache.trim(4)
    for cache in caches:
        keys, _ = cache.update_and_fetch(*step)
    assert [c.offset for c in caches] == [5] * LAYERS
    want = mx.concatenate([prompt[-1][0][:, :, :4], step[0]], axis=2)
    assert mx.array_equal(keys, want).item()
    caches[0].release()
    assert pool.stats.blocks_in_use() == 0


def test_a_draft_models_caches_on_the_same_owner_are_not_trimmed_by_its_failure():
    # The undo covers the failing model's caches only: over every cache of the owner, the
    # other model's layers that sit at the failing step's end would lose a token rightly taken.
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=2 * 6))
    main, draft = (build_pooled_caches(SimpleNamespace(layers=[None] * 2), pool, owner=1)
                   for _ in "md")
    for cache in main + draft:
        cache.update_and_fetch(*kv(BS, 0))
    for cache in main:
        cache.update_and_fetch(*kv(1, 1))  # takes the last free blocks
    with pytest.raises(BlockPoolExhaustedError):
        draft[0].update_and_fetch(*kv(1, 1))
    assert [c.offset for c in main] == [BS + 1] * 2 and [c.offset for c in draft] == [BS] * 2


def test_caches_dropped_without_release_do_not_keep_their_pool():
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=64))
    caches = [PoolBackedKVCache(pool, owner=7) for _ in range(LAYERS)]
    caches[0].update_and_fetch(*kv(5, 0))
    table = leases._LEASES[id(pool)]
    assert len(table) == 1
    del caches
    gc.collect()
    # Held strongly, the table would keep the lease (and through it the pool) for good.
    assert len(table) == 0
    # A later lease drops the emptied table.
    other = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=8))
    kept = PoolBackedKVCache(other, owner=1)
    assert id(pool) not in leases._LEASES or id(pool) == id(other)
    kept.release()


def test_a_released_lease_still_frees_the_blocks_of_its_owner_once():
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=64))
    caches = [PoolBackedKVCache(pool, owner=3) for _ in range(LAYERS)]
    for cache in caches:
        cache.update_and_fetch(*kv(6, 1))
    caches[2].release()
    assert pool.stats.blocks_in_use() == 0
    with pytest.raises(CacheReleasedError, match="were released"):
        caches[0].update_and_fetch(*kv(1, 2))


def test_storage_read_refuses_another_pools_block_and_leaves_ours_intact():
    pool, other = (BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=4)) for _ in "ab")
    storage = MLXBlockStorage(pool, head_dim=2)
    (ours,) = pool.allocate("k", BS, owner=1)
    storage.write(ours, 0, mx.full((BS, 2), 7, dtype=mx.float16))
    other.free(other.allocate("k", BS, owner=1))
    (theirs,) = other.allocate("k", BS, owner=2)  # same id, handed out twice
    assert theirs.block_id == ours.block_id and theirs.checkouts != ours.checkouts
    with pytest.raises(ForeignBlockError, match="read each pool's blocks"):
        storage.read(theirs)
    assert storage.read(ours).tolist() == [[7, 7]] * BS


def test_prometheus_counts_are_integers_in_either_build():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    pool.allocate("k", 40, owner=1)
    text = pool.stats.to_prometheus()
    assert "veloxquant_block_pool_blocks_in_use 3\n" in text
    assert "veloxquant_block_pool_allocations_total 3\n" in text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["veloxquant_block_pool_fragmentation"] == pytest.approx(1 / 8)


@pytest.mark.parametrize("method", ["free_all", "blocks_for", "n_blocks_held",
                                    "n_blocks_held_per_stream", "release_owner"])
def test_owner_lookups_refuse_a_non_integer_owner(method):
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=8))
    pool.allocate("k", 4, owner=1)
    with pytest.raises(PoolArgumentTypeError, match="owner must be an int"):
        getattr(pool, method)("1")
    assert pool.n_blocks_held(1) == 1


@pytest.mark.parametrize("seed", ["x", -1, 1.5, True])
def test_a_bad_seed_is_refused_naming_it(seed):
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        KVCacheConfig(seed=seed)


def test_kivi_names_residual_length_not_head_dim():
    with pytest.raises(ValueError, match="residual_length=40 must be a positive multiple") as info:
        KVCacheConfig(method="kivi", head_dim=128, residual_length=40)
    assert "head_dim" not in str(info.value)


def test_pooled_cache_refuses_a_missing_pool_and_typed_use_after_release():
    inner = KVCacheBuilder().with_method("turboquant_mse").with_head_dim(8).build()
    with pytest.raises(PoolArgumentTypeError, match="pool must be a BlockPoolAllocator"):
        PooledKVCache(inner, None, 1)
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=8))
    cache = PooledKVCache(inner, pool, 1)
    cache.release()
    with pytest.raises(CacheReleasedError):
        cache.append(mx.ones((1, 8)), mx.ones((1, 8)))


def test_a_paired_allocation_that_cannot_fit_moves_no_counter_but_exhausted():
    from veloxquant_mlx.memory.pool_kv_common import allocate_kv

    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=3))  # k: 2 blocks, v: 1
    with pytest.raises(BlockPoolExhaustedError) as info:
        allocate_kv(pool, 1, 2 * BS, "fp16")
    assert info.value.stream == "v"
    stats = pool.stats
    assert (stats.n_allocations, stats.n_frees, stats.peak_blocks_in_use) == (0, 0, 0)
    assert stats.n_exhausted == 1
    k, v = allocate_kv(pool, 1, BS, "fp16")  # and the pair still comes back as (k, v)
    assert [b.stream for b in k + v] == ["k", "v"]


@pytest.mark.parametrize("value", [2.0, True, "1"])
def test_n_used_refuses_a_non_int_with_the_typed_error_in_either_build(value):
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=4))
    (block,) = pool.allocate("k", 2, owner=1)
    with pytest.raises(PoolArgumentTypeError, match="n_used must be an int"):
        block.n_used = value
    assert block.n_used == 2
