"""The allocator's edge cases: int subclasses, huge growth, checkouts.

Named test_block_pool_* so that it also runs on the pure-Python source
(test_block_pool_pure_python.py) when the compiled build is in use.
"""

from __future__ import annotations

import enum
import time

import pytest

import veloxquant_mlx.memory as memory
from veloxquant_mlx.memory import (
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolArgumentError,
    PoolArgumentTypeError,
    PoolConfig,
)


class Req(enum.IntEnum):
    A = 3


class MyInt(int):
    pass


def test_int_subclasses_are_accepted_as_owner_and_n_tokens():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    pool.register_owner(Req.A)
    (block,) = pool.allocate("k", MyInt(16), owner=Req.A)
    assert type(block.owner) is int and block.owner == 3
    assert pool.blocks_for(3) == [block]
    pool.transfer([block], MyInt(7))
    assert block.owner == 7 and type(block.owner) is int
    pool.free_all(7)
    assert pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_non_int_owner_still_gets_the_typed_error(bad):
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=8))
    with pytest.raises(PoolArgumentTypeError):
        pool.allocate("k", 4, owner=bad)
    with pytest.raises(PoolArgumentTypeError):
        pool.register_owner(bad)
    assert pool.stats.n_allocations == 0


def test_growth_that_cannot_fit_in_memory_is_refused_at_once():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4, grow_on_exhaustion=True))
    start = time.perf_counter()
    with pytest.raises(BlockPoolExhaustedError, match="more memory than this machine has"):
        pool.allocate("k", 10**14, owner=1)
    assert time.perf_counter() - start < 1.0
    assert len(pool._blocks) == 4 and pool._next_id == 4
    assert (pool.stats.n_blocks, pool.stats.n_grown, pool.stats.n_exhausted) == (4, 0, 1)
    # Growth still works, with fresh ids after the existing ones.
    blocks = pool.allocate("k", 64, owner=2)
    assert sorted(b.block_id for b in blocks) == [0, 1, 4, 5]
    assert len(pool._blocks) == 6


@pytest.mark.skipif(memory.NATIVE_ALLOCATOR, reason="patches a module global of the source")
def test_growth_running_out_of_memory_part_way_leaves_no_orphan_blocks(monkeypatch):
    from veloxquant_mlx.memory import free_stacks

    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4, grow_on_exhaustion=True))
    real, made = free_stacks.Block, []

    def block_until_memory_runs_out(*args):
        if len(made) == 5:
            raise MemoryError
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(free_stacks, "Block", block_until_memory_runs_out)
    with pytest.raises(BlockPoolExhaustedError, match="ran out of memory"):
        pool.allocate("k", 16 * 12, owner=1)
    assert len(pool._blocks) == 4 and pool._next_id == 4
    assert pool.stats.n_blocks == 4 and pool.stats.n_exhausted == 1
    monkeypatch.undo()
    assert len(pool.allocate("k", 16 * 12, owner=1)) == 12


def test_checkouts_count_hand_outs_not_transfers():
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    (block,) = pool.allocate("k", 4, owner=1)
    assert block.checkouts == 1
    pool.transfer([block], 2)
    assert block.checkouts == 1
    pool.free_all(2)
    (again,) = pool.allocate("k", 4, owner=3)
    assert again is block and block.checkouts == 2
    more = pool.allocate("k", 5, owner=3)  # the multi-block path counts too
    assert [b.checkouts for b in more] == [1, 1]


def test_bad_config_and_bad_free_arguments_get_typed_errors():
    with pytest.raises(PoolArgumentTypeError):
        BlockPoolAllocator("x")
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=4))
    (block,) = pool.allocate("k", 4, owner=1)
    for bad in (None, block, 3):
        with pytest.raises(PoolArgumentTypeError):
            pool.free(bad)
    assert block.owner == 1 and pool.stats.n_frees == 0


@pytest.mark.parametrize("prefix", ["my-pool", "", "9lives", "a b"])
def test_prometheus_prefix_must_be_a_metric_name(prefix):
    with pytest.raises(PoolArgumentError):
        BlockPoolAllocator().stats.to_prometheus(prefix=prefix)
