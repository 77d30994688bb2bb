"""Storage privacy, caches against free_all, all-or-nothing failures."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    PoolArgumentError,
    PoolArgumentTypeError,
    VeloxQuantError,
)
from veloxquant_mlx.memory import (
    BlockPoolAllocator,
    MLXBlockStorage,
    PoolBackedKVCache,
    PoolConfig,
    PooledKVCache,
)


def pool_of(block_size: int = 4, n_blocks: int = 64) -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=block_size, n_blocks=n_blocks))


def ones(n: int, batch: int = 1) -> mx.array:
    return mx.ones((batch, 2, n, 8))


def held(pool: BlockPoolAllocator) -> dict[int, int]:
    return pool.blocks_held_by_owner()


# -- MLXBlockStorage never shows a previous owner's rows ----------------------------


def test_new_owner_reads_zeros_not_the_previous_owners_rows():
    pool = pool_of(n_blocks=4)
    storage = MLXBlockStorage(pool, head_dim=3)
    (block,) = pool.allocate("k", 4, owner=1)
    storage.write(block, 0, mx.full((4, 3), 7.0, dtype=mx.float16))
    buffer = storage._buffers[block.block_id]
    pool.free_all(1)
    (again,) = pool.allocate("k", 4, owner=2)
    assert again is block and again.n_used == 4  # allocate() marks the rows used
    assert storage.read(again).tolist() == [[0.0] * 3] * 4
    assert storage._buffers[block.block_id] is buffer  # cleared in place, not re-made


def test_partial_write_by_a_new_owner_shows_zeros_in_the_unwritten_rows():
    pool = pool_of(n_blocks=4)
    storage = MLXBlockStorage(pool, head_dim=2)
    (block,) = pool.allocate("k", 4, owner=1)
    storage.write(block, 0, mx.full((4, 2), 5.0, dtype=mx.float16))
    pool.free_all(1)
    (block,) = pool.allocate("k", 1, owner=2)
    storage.write(block, 0, mx.full((1, 2), 1.0, dtype=mx.float16))
    storage.write(block, 3, mx.full((1, 2), 2.0, dtype=mx.float16))  # leaves a gap
    assert storage.read(block).tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [2.0, 2.0]]


def test_a_transferred_block_keeps_its_rows():
    pool = pool_of(n_blocks=4)
    storage = MLXBlockStorage(pool, head_dim=2)
    (block,) = pool.allocate("k", 2, owner=1)
    storage.write(block, 0, mx.full((2, 2), 3.0, dtype=mx.float16))
    pool.transfer([block], 9)  # the prefix cache's hand-over: same data, new owner
    assert storage.read(block).tolist() == [[3.0, 3.0], [3.0, 3.0]]


def test_a_zero_row_write_does_not_claim_rows():
    pool = pool_of(n_blocks=4)
    storage = MLXBlockStorage(pool, head_dim=2)
    (block,) = pool.allocate("k", 1, owner=1)
    storage.write(block, 3, mx.zeros((0, 2), dtype=mx.float16))
    assert block.n_used == 1


# -- a cache whose owner was free_all()'d never touches another owner's blocks ------


def test_pool_backed_cache_after_free_all_raises_and_leaves_the_new_owner_alone():
    pool = pool_of(n_blocks=64)
    a = PoolBackedKVCache(pool, owner=1)
    a.update_and_fetch(ones(6), ones(6))
    pool.free_all(1)
    b = PoolBackedKVCache(pool, owner=2)
    b.update_and_fetch(ones(6), ones(6))  # takes a's recycled blocks
    before = [blk.n_used for blk in pool.blocks_for(2)]
    with pytest.raises(VeloxQuantError, match="no longer belongs to owner 1"):
        a.update_and_fetch(ones(1), ones(1))
    with pytest.raises(VeloxQuantError, match="no longer belongs"):
        a.trim(6)
    assert [blk.n_used for blk in pool.blocks_for(2)] == before
    assert held(pool) == {2: 4}


def test_pool_backed_cache_after_free_all_raises_even_before_reuse():
    pool = pool_of(n_blocks=64)
    a = PoolBackedKVCache(pool, owner=1)
    a.update_and_fetch(ones(3), ones(3))
    pool.free_all(1)
    with pytest.raises(VeloxQuantError, match="free_all"):
        a.update_and_fetch(ones(1), ones(1))
    assert held(pool) == {}


def test_pooled_cache_after_free_all_raises_and_leaves_the_new_owner_alone():
    pool = pool_of(n_blocks=64)
    a = PooledKVCache(_inner(), pool, owner=1)
    a.append(*_kv(1))
    pool.free_all(1)
    b = PooledKVCache(_inner(), pool, owner=2)
    b.append(*_kv(1))
    with pytest.raises(VeloxQuantError, match="no longer belongs to owner 1"):
        a.append(*_kv(1))
    assert [blk.n_used for blk in pool.blocks_for(2)] == [1, 1]
    assert a.n_keys == 1 and a.n_values == 1


# -- PooledKVCache.append is all-or-nothing ---------------------------------------


def _inner():
    return KVCacheBuilder().with_method("turboquant_mse").with_head_dim(8).with_bits(2).build()


def _kv(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((n, 8), np.float32), np.ones((n, 8), np.float32)


def test_pooled_append_that_exhausts_the_values_stores_no_keys():
    pool = pool_of(n_blocks=5)  # k: 3 blocks, v: 2
    cache = PooledKVCache(_inner(), pool, owner=1)
    with pytest.raises(BlockPoolExhaustedError):
        cache.append(*_kv(12))
    assert (cache.n_keys, cache.n_values, cache.n_blocks_held()) == (0, 0, 0)
    assert held(pool) == {} and pool.active_owners() == [1]
    cache.append(*_kv(8))  # what fits still goes in, keys and values together
    assert (cache.n_keys, cache.n_values, cache.n_blocks_held()) == (8, 8, 4)


# -- PoolBackedKVCache failure paths change nothing ----------------------------------


@pytest.mark.parametrize("bad, error", [
    (lambda: (mx.ones((2, 6, 8)), mx.ones((2, 6, 8))), PoolArgumentError),
    (lambda: (np.ones((1, 2, 6, 8)), np.ones((1, 2, 6, 8))), PoolArgumentTypeError),
    (lambda: (mx.ones((1, 2, 6, 8)), mx.ones((1, 2, 5, 8))), PoolArgumentError),
])
def test_malformed_update_allocates_nothing(bad, error):
    pool = pool_of()
    cache = PoolBackedKVCache(pool, owner=1)
    with pytest.raises(error):
        cache.update_and_fetch(*bad())
    assert cache.offset == 0 and held(pool) == {}


def test_update_whose_write_fails_gives_back_the_blocks_it_took():
    pool = pool_of()
    cache = PoolBackedKVCache(pool, owner=1)
    cache.update_and_fetch(ones(2), ones(2))
    with pytest.raises(ValueError):  # 3 heads into a 2-head buffer: MLX refuses the write
        cache.update_and_fetch(mx.ones((1, 3, 8, 8)), mx.ones((1, 3, 8, 8)))
    assert cache.offset == 2 and held(pool) == {1: 2}


def test_state_setter_on_a_too_small_pool_keeps_the_old_state():
    pool = pool_of(block_size=16, n_blocks=4)
    cache = PoolBackedKVCache(pool, owner=1)
    cache.update_and_fetch(ones(3), ones(3))
    with pytest.raises(BlockPoolExhaustedError):
        cache.state = (ones(40), ones(40), 40)
    assert cache.offset == 3 and cache.state[0].shape[2] == 3
    assert held(pool) == {1: 2}


@pytest.mark.parametrize("n, error", [(-1000, PoolArgumentError), (-1, PoolArgumentError),
                                      (2.5, PoolArgumentTypeError),
                                      ("1", PoolArgumentTypeError)])
def test_bad_trim_is_refused_before_anything_changes(n, error):
    pool = pool_of()
    cache = PoolBackedKVCache(pool, owner=1)
    cache.update_and_fetch(ones(6), ones(6))
    with pytest.raises(error):
        cache.trim(n)
    assert cache.offset == 6 and held(pool) == {1: 4}
    assert cache.trim(np.int64(2)) == 2 and cache.offset == 4


def test_meta_state_cannot_take_the_step_of_an_attached_cache():
    cache = PoolBackedKVCache(pool_of(), owner=1)
    with pytest.raises(ValueError, match="step"):
        cache.meta_state = ("0", "1")
    assert cache.step == 4 and cache.buffer_step == 256
    cache.update_and_fetch(ones(5), ones(5))


# -- compression configs refuse non-int counts up front ------------------------------


@pytest.mark.parametrize("kwargs", [
    {"method": "turboquant_mse", "bits": True},
    {"method": "qjl", "bits": True},
    {"method": "qjl", "group_size": 32.0},
    {"method": "kivi", "group_size": "32"},
    {"method": "kivi", "residual_length": 8.5},
])
def test_compression_config_refuses_non_int_counts(kwargs):
    from veloxquant_mlx import KVCacheConfig

    with pytest.raises(ValueError):
        KVCacheConfig(head_dim=64, **kwargs)


# -- bad arguments get typed errors -----------------------------------------------------


def test_storage_refuses_a_non_pool_a_bad_offset_and_another_pools_block():
    from veloxquant_mlx.exceptions import ForeignBlockError

    with pytest.raises(PoolArgumentTypeError):
        MLXBlockStorage(None, 2)
    pool, other = pool_of(n_blocks=4), pool_of(n_blocks=4)
    storage = MLXBlockStorage(pool, head_dim=2)
    (block,) = pool.allocate("k", 4, owner=1)
    rows = mx.ones((1, 2), dtype=mx.float16)
    for offset in (1.5, True, None):
        with pytest.raises(PoolArgumentTypeError):
            storage.write(block, offset, rows)
    (foreign,) = other.allocate("k", 4, owner=1)
    with pytest.raises(ForeignBlockError):
        storage.write(foreign, 0, rows)
    assert storage.n_resident() == 0


@pytest.mark.parametrize("pool, owner", [(None, 1), ("pool", 1), ("ok", "x"), ("ok", None)])
def test_pool_backed_cache_refuses_bad_constructor_arguments(pool, owner):
    real = pool_of()
    with pytest.raises(PoolArgumentTypeError):
        PoolBackedKVCache(real if pool == "ok" else pool, owner)
    assert held(real) == {}
