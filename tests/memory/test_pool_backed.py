"""PoolBackedKVCache against the stock mlx-lm KVCache, and its block accounting."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.exceptions import BlockPoolExhaustedError, VeloxQuantError
from veloxquant_mlx.memory import BlockPoolAllocator, PoolBackedKVCache, PoolConfig

BS = 16
HEADS, K_DIM, V_DIM = 2, 8, 6


def make_pool(n_blocks: int = 256, **kwargs) -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks, **kwargs))


def kv(n: int, seed: int, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k_key, v_key = mx.random.split(key)
    keys = mx.random.normal((1, HEADS, n, K_DIM), key=k_key).astype(dtype)
    values = mx.random.normal((1, HEADS, n, V_DIM), key=v_key).astype(dtype)
    return keys, values


def assert_same(got, want) -> None:
    """Exact equality of shape, dtype and every element."""
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert mx.array_equal(got, want).item()


# A replay script: ("update", n) appends n tokens, ("trim", n) trims n.
SCRIPT = [
    ("update", 37), *[("update", 1)] * 30, ("trim", 5), *[("update", 1)] * 4,
    ("update", 300), ("trim", 290), ("update", 17), *[("update", 1)] * 20,
    ("trim", 1000), ("update", 3), ("update", 260),
]


def replay(stock, pooled, script, dtype, check=None) -> None:
    for i, (op, n) in enumerate(script):
        if op == "update":
            keys, values = kv(n, seed=i, dtype=dtype)
            want = stock.update_and_fetch(keys, values)
            got = pooled.update_and_fetch(keys, values)
            assert_same(got[0], want[0])
            assert_same(got[1], want[1])
        else:
            assert pooled.trim(n) == stock.trim(n)
        assert pooled.offset == stock.offset
        assert pooled.size() == stock.size()
        assert pooled.empty() == stock.empty()
        if check is not None:
            check(pooled)


def expected_blocks(offset: int) -> int:
    return -(-offset // BS)


def check_accounting(cache: PoolBackedKVCache) -> None:
    """Blocks held match real use: step == block size, n_used exact per block."""
    pool = cache.pool
    n = expected_blocks(cache.offset)
    assert pool.stats.blocks_in_use() == 2 * n
    blocks = pool.blocks_for(cache.owner)
    k_used = [b.n_used for b in blocks if b.stream == "k"]
    want = [min(BS, cache.offset - i * BS) for i in range(n)]
    assert sorted(k_used, reverse=True) == want
    assert sorted(b.n_used for b in blocks if b.stream == "v") == sorted(want)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_replay_is_bit_identical_to_stock_and_accounting_follows_use(dtype):
    pool = make_pool()
    replay(KVCache(), PoolBackedKVCache(pool, owner=7), SCRIPT, dtype, check_accounting)


def test_state_round_trip_is_bit_identical():
    stock, pooled = KVCache(), PoolBackedKVCache(make_pool(), owner=1)
    replay(stock, pooled, SCRIPT[:40], mx.float32)
    s_keys, s_values, s_offset = stock.state
    p_keys, p_values, p_offset = pooled.state
    assert p_offset == s_offset == 94
    assert_same(p_keys, s_keys[..., :s_offset, :])
    assert_same(p_values, s_values[..., :s_offset, :])

    stock2, pool2 = KVCache(), make_pool()
    pooled2 = PoolBackedKVCache(pool2, owner=2)
    stock2.state = stock.state
    pooled2.state = pooled.state
    assert pool2.stats.blocks_in_use() == 2 * expected_blocks(94)
    replay(stock2, pooled2, [("update", 1), ("update", 250), ("trim", 3)], mx.float32)
    check_accounting(pooled2)


def test_mask_and_metadata_match_stock():
    stock, pooled = KVCache(), PoolBackedKVCache(make_pool(), owner=1)
    assert pooled.nbytes == stock.nbytes == 0
    replay(stock, pooled, [("update", 20)], mx.float32)
    assert pooled.is_trimmable() and stock.is_trimmable()
    assert pooled.nbytes == stock.nbytes  # same 256-token buffer
    def masks(n, return_array, window_size):
        return [
            c.make_mask(n, return_array=return_array, window_size=window_size)
            for c in (pooled, stock)
        ]

    assert masks(1, False, None) == [None, None]
    assert masks(5, False, None) == ["causal", "causal"]
    assert_same(*masks(5, True, None))
    assert_same(*masks(5, False, 8))


def test_step_larger_than_block_allocates_in_step_chunks_with_exact_n_used():
    pool = make_pool()
    cache = PoolBackedKVCache(pool, owner=3, step=48)
    cache.update_and_fetch(*kv(1, 0))
    blocks = pool.blocks_for(3)
    assert [b.stream for b in blocks] == ["k"] * 3 + ["v"] * 3
    assert [b.n_used for b in blocks] == [1, 0, 0, 1, 0, 0]
    cache.update_and_fetch(*kv(20, 1))
    assert [b.n_used for b in pool.blocks_for(3)] == [16, 5, 0, 16, 5, 0]
    cache.update_and_fetch(*kv(28, 2))  # 49 tokens: one more step of 3 blocks
    assert pool.stats.blocks_in_use() == 12
    assert pool.stats.n_partial == 6  # (block 3: 1 used) + 2 empty, per stream


def test_trim_returns_surplus_blocks_to_the_pool():
    pool = make_pool()
    cache = PoolBackedKVCache(pool, owner=1)
    cache.update_and_fetch(*kv(70, 0))
    assert pool.stats.blocks_in_use() == 10
    assert cache.trim(40) == 40
    assert pool.stats.blocks_in_use() == 4
    assert [b.n_used for b in pool.blocks_for(1)] == [16, 14, 16, 14]
    assert cache.trim(100) == 30
    assert pool.stats.blocks_in_use() == 0


def test_block_format_follows_the_cache_dtype():
    pool = make_pool()
    PoolBackedKVCache(pool, owner=1).update_and_fetch(*kv(3, 0, mx.float16))
    PoolBackedKVCache(pool, owner=2).update_and_fetch(*kv(3, 0, mx.float32))
    assert {b.format for b in pool.blocks_for(1)} == {"fp16"}
    assert {b.format for b in pool.blocks_for(2)} == {"fp32"}


def test_exhaustion_raises_and_leaves_cache_and_pool_unchanged():
    pool = make_pool(n_blocks=5)  # k gets 3 blocks, v gets 2
    cache = PoolBackedKVCache(pool, owner=1)
    cache.update_and_fetch(*kv(32, 0))
    with pytest.raises(BlockPoolExhaustedError) as err:
        cache.update_and_fetch(*kv(1, 1))
    assert err.value.stream == "v"
    assert cache.offset == 32
    assert pool.stats.blocks_in_use() == 4  # the k block taken for the failed step went back
    assert pool.n_free("k") == 1


def test_shared_kv_stream_pool_works():
    pool = make_pool(separate_kv=False)
    stock, pooled = KVCache(), PoolBackedKVCache(pool, owner=1)
    replay(stock, pooled, [("update", 17), ("update", 1)], mx.float32)
    assert {b.stream for b in pool.blocks_for(1)} == {"kv"}
    assert pool.stats.blocks_in_use() == 4


def test_release_frees_all_layers_once_and_never_a_new_owners_blocks():
    pool = make_pool()
    layers = [PoolBackedKVCache(pool, owner=5) for _ in range(3)]
    for layer in layers:
        layer.update_and_fetch(*kv(20, 0))
    assert pool.stats.blocks_in_use() == 12
    layers[1].release()
    assert pool.stats.blocks_in_use() == 0
    assert all(layer.released for layer in layers)
    assert [layer.n_blocks_held() for layer in layers] == [0, 0, 0]

    # The owner id is reused by a new request; the old caches must not touch it.
    fresh = PoolBackedKVCache(pool, owner=5)
    fresh.update_and_fetch(*kv(3, 1))
    layers[0].release()
    layers[2].release()
    assert pool.stats.blocks_in_use() == 2
    assert not fresh.released
    fresh.release()
    assert pool.stats.blocks_in_use() == 0
    assert pool.stats.n_frees == 14


def test_use_after_release_raises():
    cache = PoolBackedKVCache(make_pool(), owner=1)
    cache.update_and_fetch(*kv(2, 0))
    cache.release()
    with pytest.raises(VeloxQuantError, match="were released"):
        cache.update_and_fetch(*kv(1, 1))
    with pytest.raises(VeloxQuantError, match="were released"):
        cache.trim(1)
    assert cache.trim(0) == 0


def test_detached_cache_from_state_must_be_attached_before_use():
    source = PoolBackedKVCache(make_pool(), owner=1)
    source.update_and_fetch(*kv(40, 0))
    loaded = PoolBackedKVCache.from_state(source.state)
    assert loaded.offset == 40 and loaded.pool is None
    with pytest.raises(VeloxQuantError, match="not attached"):
        loaded.update_and_fetch(*kv(1, 1))
    pool = make_pool()
    loaded.attach(pool, owner=9)
    assert pool.stats.blocks_in_use() == 2 * expected_blocks(40)
    check_accounting(loaded)
    with pytest.raises(VeloxQuantError, match="already attached"):
        loaded.attach(pool, owner=10)


def test_failed_attach_leaves_the_cache_detached_and_attachable():
    source = PoolBackedKVCache(make_pool(), owner=1)
    source.update_and_fetch(*kv(40, 0))
    loaded = PoolBackedKVCache.from_state(source.state)
    small = make_pool(n_blocks=4)
    with pytest.raises(BlockPoolExhaustedError):
        loaded.attach(small, owner=2)
    assert loaded.pool is None and small.stats.blocks_in_use() == 0
    big = make_pool()
    loaded.attach(big, owner=2)
    check_accounting(loaded)


def test_meta_state_round_trips():
    cache = PoolBackedKVCache(make_pool(), owner=1, step=32, buffer_step=64)
    assert cache.meta_state == ("32", "64")
    clone = PoolBackedKVCache.from_state(cache.state, cache.meta_state)
    assert (clone.step, clone.buffer_step) == (32, 64)


def test_small_buffer_step_changes_memory_not_output():
    stock, pooled = KVCache(), PoolBackedKVCache(make_pool(), owner=1, buffer_step=BS)
    replay(stock, pooled, SCRIPT, mx.float32, check_accounting)
    assert pooled.keys.shape[2] <= stock.keys.shape[2]


def test_unsupported_conversions_raise_clear_errors():
    cache = PoolBackedKVCache(make_pool(), owner=1)
    with pytest.raises(VeloxQuantError, match="without kv_bits"):
        cache.to_quantized(group_size=64, bits=4)
    with pytest.raises(VeloxQuantError, match="make_batch_caches"):
        PoolBackedKVCache.merge([cache])


@pytest.mark.parametrize("kwargs", [{"step": 0}, {"step": True}, {"buffer_step": -4}])
def test_bad_steps_raise(kwargs):
    with pytest.raises(ValueError, match="must be a positive int"):
        PoolBackedKVCache(make_pool(), owner=1, **kwargs)
