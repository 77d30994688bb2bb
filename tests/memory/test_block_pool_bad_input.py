"""Bad input to the allocator: a clear typed error and no change of state."""

from __future__ import annotations

import pytest

from veloxquant_mlx.memory import (
    Block,
    BlockPoolAllocator,
    ForeignBlockError,
    PoolArgumentError,
    PoolArgumentTypeError,
    PoolConfig,
    VeloxQuantError,
)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"block_size": 0}, "block_size"),
        ({"n_blocks": 0}, "n_blocks"),
        ({"n_blocks": -3}, "n_blocks"),
        ({"n_blocks": 8, "max_blocks": 4}, "max_blocks"),
    ],
)
def test_pool_config_value_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PoolConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"block_size": 1.5}, {"n_blocks": True}, {"separate_kv": 1}, {"max_blocks": "9"}]
)
def test_pool_config_type_errors(kwargs):
    with pytest.raises(TypeError):
        PoolConfig(**kwargs)


def _state(pool: BlockPoolAllocator):
    return (pool.snapshot(), pool.n_free("kv"), pool.active_owners(), len(pool.history))


@pytest.mark.parametrize(
    "n_tokens, error",
    [
        (0, PoolArgumentError),
        (-4, PoolArgumentError),
        (True, PoolArgumentTypeError),
        (2.0, PoolArgumentTypeError),
        ("16", PoolArgumentTypeError),
        (None, PoolArgumentTypeError),
    ],
)
def test_bad_n_tokens_leaves_state_unchanged(n_tokens, error):
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    pool.allocate("k", 16, owner=1)
    before = _state(pool)
    with pytest.raises(error, match="n_tokens") as info:
        pool.allocate("k", n_tokens, owner=2)
    assert isinstance(info.value, VeloxQuantError)
    assert _state(pool) == before


@pytest.mark.parametrize("stream", ["kv", "q", "", None, 3])
def test_unknown_stream_on_split_pool(stream):
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    before = _state(pool)
    with pytest.raises(ValueError, match="stream") as info:
        pool.allocate(stream, 16, owner=1)
    assert "'k'" in str(info.value) and "'v'" in str(info.value)
    assert _state(pool) == before


def test_unknown_stream_on_shared_pool():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12, separate_kv=False))
    with pytest.raises(ValueError, match="stream"):
        pool.allocate("x", 16, owner=1)
    with pytest.raises(ValueError, match="stream"):
        pool.n_free("x")


@pytest.mark.parametrize("owner", ["a", 1.0, None, True])
def test_owner_must_be_an_int(owner):
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    with pytest.raises(TypeError, match="owner"):
        pool.allocate("k", 16, owner=owner)
    with pytest.raises(TypeError, match="owner"):
        pool.register_owner(owner)
    assert pool.stats.n_allocations == 0


def test_format_must_be_a_string():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    with pytest.raises(TypeError, match="format"):
        pool.allocate("k", 16, owner=1, format=4)


def test_free_of_a_block_from_another_pool_changes_nothing():
    ours = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    theirs = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    mine = ours.allocate("k", 16, owner=1)
    foreign = theirs.allocate("k", 16, owner=1)
    before = _state(ours)
    with pytest.raises(ForeignBlockError, match="does not belong"):
        ours.free(mine + foreign)
    assert _state(ours) == before and mine[0].owner == 1 and foreign[0].owner == 1
    with pytest.raises(ForeignBlockError):
        ours.free([Block(0, "k")])  # a look-alike, not the pool's own object
    with pytest.raises(ForeignBlockError):
        ours.free(["not a block"])


def test_free_of_a_retired_block_is_rejected():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4))
    blocks = pool.allocate("k", 16, owner=1)
    pool.free_all(1)
    pool.shrink("k", 0)
    with pytest.raises(ForeignBlockError, match="retired"):
        pool.free(blocks)
