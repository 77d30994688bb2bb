"""Counters and owner bookkeeping, each pinned so that a mutation of it fails a test.

``n_reused`` on the many-block path when every block taken is a recycled one
(and when some are fresh), and ``release_owner`` of an owner that holds
nothing or was never seen.
"""

from __future__ import annotations

import pytest

from veloxquant_mlx.memory import BlockPoolAllocator, OwnerAlreadyActiveError, PoolConfig


def make_pool(n_blocks: int = 16) -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=n_blocks))


def test_reallocating_several_recycled_blocks_counts_each_as_reused():
    pool = make_pool()  # 8 blocks per stream
    pool.allocate("k", 48, owner=1)  # 3 fresh blocks
    assert pool.stats.n_reused == 0
    pool.free_all(1)
    again = pool.allocate("k", 48, owner=2)  # the same 3, all recycled
    assert len(again) == 3 and pool.stats.n_reused == 3
    pool.free_all(2)
    pool.allocate("k", 64, owner=3)  # 3 recycled + 1 fresh
    assert pool.stats.n_reused == 6 and pool.stats.n_allocations == 10


def test_release_owner_of_a_registered_owner_holding_nothing():
    pool = make_pool()
    pool.register_owner(7)
    assert pool.active_owners() == [7]
    before = pool.snapshot()
    pool.release_owner(7)
    assert pool.active_owners() == [] and pool.blocks_held_by_owner() == {}
    assert pool.n_blocks_held(7) == 0 and pool.snapshot() == before
    pool.register_owner(7)  # gone for good: the id can be claimed again
    assert pool.active_owners() == [7]
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(7)


def test_release_owner_of_an_unknown_owner_changes_nothing():
    pool = make_pool()
    pool.allocate("k", 20, owner=1)
    before = pool.snapshot()
    pool.release_owner(99)
    assert pool.active_owners() == [1] and pool.snapshot() == before
    assert pool.blocks_held_by_owner() == {1: 2}
    pool.register_owner(99)  # never seen, never active: claimable
    assert pool.active_owners() == [1, 99]


def test_release_owner_keeps_held_blocks_reachable_for_free_all():
    pool = make_pool()
    pool.allocate("k", 20, owner=1)
    pool.release_owner(1)
    assert pool.active_owners() == [] and pool.n_blocks_held(1) == 2
    pool.free_all(1)
    assert pool.stats.blocks_in_use() == 0 and pool.n_blocks_held(1) == 0
