"""One test per documented behaviour of the allocator, on tiny pools with exact block ids."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from veloxquant_mlx.memory import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)


def make_pool(n_blocks: int = 12, block_size: int = 16, **kw) -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=block_size, n_blocks=n_blocks, **kw))


def ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def test_pool_config_defaults_match_the_spec():
    cfg = PoolConfig()
    assert (cfg.block_size, cfg.n_blocks, cfg.separate_kv) == (16, 1024, True)
    assert (cfg.grow_on_exhaustion, cfg.max_blocks) == (False, None)


def test_allocate_hands_out_ceil_of_tokens_over_block_size():
    pool = make_pool()
    assert ids(pool.allocate("k", 40, owner=1)) == [0, 1, 2]
    assert ids(pool.allocate("k", 16, owner=1)) == [3]
    assert ids(pool.allocate("k", 17, owner=1)) == [4, 5]


def test_allocate_sets_n_used_full_blocks_then_remainder():
    pool = make_pool()
    blocks = pool.allocate("k", 40, owner=1, format="int4")
    assert [b.n_used for b in blocks] == [16, 16, 8]
    assert all(b.owner == 1 and b.format == "int4" and b.ever_allocated for b in blocks)
    assert [b.stream for b in blocks] == ["k", "k", "k"]


def test_spec_example_stats_and_repr():
    pool = make_pool(n_blocks=64)
    pool.allocate(stream="k", n_tokens=40, owner=1)
    assert repr(pool.stats) == (
        "AllocationStats(in_use=3/64, allocations=3, frees=0, reused=0, exhausted=0, "
        "grown=0, retired=0, peak=3, fragmentation=0.016)"
    )


def test_counters_count_blocks_not_calls():
    pool = make_pool()
    pool.allocate("k", 48, owner=1)
    pool.free_all(1)
    assert (pool.stats.n_allocations, pool.stats.n_frees) == (3, 3)
    assert pool.stats.blocks_in_use() == 0


def test_allocation_is_all_or_nothing_and_counts_exhaustion():
    pool = make_pool(n_blocks=4)  # 2 "k" blocks, 2 "v" blocks
    pool.allocate("k", 16, owner=1)
    before = pool.blocks_for(1)
    with pytest.raises(BlockPoolExhaustedError) as info:
        pool.allocate("k", 48, owner=2)
    err = info.value
    assert (err.stream, err.requested, err.free) == ("k", 3, 1)
    assert "3" in str(err) and "1 free" in str(err) and "n_blocks" in str(err)
    assert pool.n_free("k") == 1 and pool.blocks_for(2) == [] and pool.blocks_for(1) == before
    # n_exhausted counts failed calls: this one asked for 3 blocks and adds 1.
    assert pool.stats.n_exhausted == 1 and pool.stats.n_allocations == 1
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 16 * 5, owner=2)
    assert pool.stats.n_exhausted == 2


def test_failed_allocation_does_not_make_a_new_owner_active():
    pool = make_pool(n_blocks=2)
    for n_tokens in (16, 48):  # the one-block path and the many-block path
        with pytest.raises(BlockPoolExhaustedError):
            pool.allocate("k", n_tokens + 16, owner=7)
        assert pool.active_owners() == []
    pool.register_owner(7)  # no collision: the failed calls claimed nothing


def test_freed_blocks_are_reused_lifo():
    pool = make_pool()
    pool.allocate("k", 32, owner=1)  # 0, 1
    pool.allocate("k", 16, owner=2)  # 2
    pool.free_all(1)
    assert ids(pool.allocate("k", 16, owner=3)) == [0]
    assert ids(pool.allocate("k", 16, owner=3)) == [1]
    assert ids(pool.allocate("k", 16, owner=3)) == [3]  # fresh again once recycled ran out


def test_n_reused_counts_recycled_blocks_only():
    pool = make_pool()
    pool.allocate("k", 32, owner=1)
    pool.free_all(1)
    pool.allocate("k", 48, owner=2)  # two recycled (0, 1) and one fresh (2)
    assert pool.stats.n_reused == 2
    assert [b.ever_allocated for b in pool.blocks_for(2)] == [True, True, True]


def test_free_is_idempotent_and_only_counts_real_frees():
    pool = make_pool()
    blocks = pool.allocate("k", 32, owner=1)
    pool.free(blocks[:1])
    pool.free(blocks[:1])
    pool.free([blocks[1], blocks[1]])
    assert pool.stats.n_frees == 2 and pool.n_free("k") == 6
    assert all(b.owner is None and b.n_used == 0 for b in blocks)


def test_free_of_last_block_retires_the_owner():
    pool = make_pool()
    blocks = pool.allocate("k", 16, owner=7)
    pool.free(blocks)
    assert pool.active_owners() == []
    pool.register_owner(7)  # no collision any more


def test_free_all_returns_every_block_of_the_owner_only():
    pool = make_pool()
    pool.allocate("k", 32, owner=1)
    pool.allocate("v", 16, owner=1)
    pool.allocate("k", 16, owner=2)
    pool.free_all(1)
    assert pool.blocks_for(1) == [] and ids(pool.blocks_for(2)) == [2]
    assert (pool.n_free("k"), pool.n_free("v")) == (5, 6)
    pool.free_all(1)  # nothing left: a no-op
    assert pool.stats.n_frees == 3


def test_blocks_for_is_in_allocation_order_across_streams():
    pool = make_pool()
    pool.allocate("v", 16, owner=1)
    pool.allocate("k", 32, owner=1)
    assert ids(pool.blocks_for(1)) == [6, 0, 1]


def test_n_free_per_stream_and_odd_split():
    pool = make_pool(n_blocks=7)
    assert (pool.n_free("k"), pool.n_free("v"), pool.n_free("kv")) == (4, 3, 7)
    assert ids(pool.allocate("v", 1, owner=1)) == [4]


def test_separate_kv_streams_do_not_compete():
    pool = make_pool(n_blocks=4)
    pool.allocate("k", 32, owner=1)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, owner=1)
    assert ids(pool.allocate("v", 32, owner=1)) == [2, 3]


def test_shared_stream_when_separate_kv_is_off():
    pool = make_pool(n_blocks=4, separate_kv=False)
    assert ids(pool.allocate("k", 16, owner=1)) == [0]
    assert ids(pool.allocate("v", 16, owner=1)) == [1]
    assert ids(pool.allocate("kv", 16, owner=1)) == [2]
    assert {b.stream for b in pool.blocks_for(1)} == {"kv"}
    assert pool.n_free("k") == pool.n_free("v") == pool.n_free("kv") == 1


def test_register_owner_detects_collisions():
    pool = make_pool()
    pool.register_owner(5)
    with pytest.raises(OwnerAlreadyActiveError) as info:
        pool.register_owner(5)
    assert info.value.owner == 5 and "already active" in str(info.value)


def test_allocate_for_active_owner_is_growth_not_collision():
    pool = make_pool()
    pool.register_owner(5)
    pool.allocate("k", 16, owner=5)
    pool.allocate("k", 16, owner=5)
    assert ids(pool.blocks_for(5)) == [0, 1]


def test_owner_with_blocks_is_active_until_free_all():
    pool = make_pool()
    pool.allocate("k", 16, owner=5)
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(5)
    pool.free_all(5)
    pool.register_owner(5)


def test_release_owner_clears_active_set_without_freeing():
    pool = make_pool()
    pool.register_owner(5)
    pool.allocate("k", 16, owner=5)
    pool.release_owner(5)
    pool.register_owner(5)
    assert ids(pool.blocks_for(5)) == [0] and pool.stats.blocks_in_use() == 1


def test_grow_on_exhaustion_grows_just_enough():
    pool = make_pool(n_blocks=4, grow_on_exhaustion=True)
    assert ids(pool.allocate("k", 64, owner=1)) == [0, 1, 4, 5]
    assert pool.stats.n_grown == 2 and pool.stats.n_blocks == 6
    assert pool.n_free("k") == 0 and pool.stats.n_exhausted == 0


def test_grow_respects_max_blocks():
    pool = make_pool(n_blocks=4, grow_on_exhaustion=True, max_blocks=5)
    assert ids(pool.allocate("k", 48, owner=1)) == [0, 1, 4]
    with pytest.raises(BlockPoolExhaustedError) as info:
        pool.allocate("k", 16, owner=1)
    assert "max_blocks=5" in str(info.value)
    assert pool.stats.n_blocks == 5 and pool.stats.n_exhausted == 1


def test_max_blocks_is_ignored_without_growth():
    pool = make_pool(n_blocks=4, max_blocks=100)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 48, owner=1)
    assert pool.stats.n_blocks == 4


def test_shrink_retires_free_blocks_coldest_first():
    pool = make_pool(n_blocks=8)  # k: 0..3
    pool.allocate("k", 16, owner=1)  # 0
    retired = pool.shrink("k", target_free=1)
    assert retired == 2 and pool.n_free("k") == 1
    assert pool.stats.n_retired == 2 and pool.stats.n_blocks == 6
    assert ids(pool.allocate("k", 16, owner=2)) == [1]  # 2 and 3 (never used) went first
    assert ids(pool.blocks_for(1)) == [0]


def test_shrink_never_touches_blocks_in_use():
    pool = make_pool(n_blocks=8)
    pool.allocate("k", 64, owner=1)
    assert pool.shrink("k", 0) == 0
    assert [b.owner for b in pool.blocks_for(1)] == [1, 1, 1, 1]


def test_shrink_kv_on_a_split_pool_shrinks_both_streams():
    pool = make_pool(n_blocks=8)
    assert pool.shrink("kv", 3) == 5
    assert (pool.n_free("k"), pool.n_free("v")) == (2, 1)


def test_shrink_rejects_negative_target():
    pool = make_pool()
    with pytest.raises(ValueError, match="target_free"):
        pool.shrink("k", -1)


def test_fragmentation_counts_partial_blocks_and_follows_writers():
    pool = make_pool(n_blocks=10)
    blocks = pool.allocate("k", 20, owner=1)  # one full, one with 4 of 16
    assert pool.stats.fragmentation() == pytest.approx(0.1)
    blocks[1].n_used = 16
    assert pool.stats.fragmentation() == 0.0
    blocks[0].n_used = 3
    assert pool.stats.fragmentation() == pytest.approx(0.1)
    pool.free_all(1)
    assert pool.stats.fragmentation() == 0.0
    assert make_pool().stats.fragmentation() == 0.0


def test_n_used_outside_the_block_is_rejected():
    pool = make_pool()
    (block,) = pool.allocate("k", 4, owner=1)
    with pytest.raises(ValueError, match="n_used"):
        block.n_used = 17
    assert block.n_used == 4


def test_peak_blocks_in_use_is_a_high_water_mark():
    pool = make_pool()
    pool.allocate("k", 48, owner=1)
    pool.free_all(1)
    pool.allocate("k", 16, owner=2)
    assert pool.stats.peak_blocks_in_use == 3 and pool.stats.blocks_in_use() == 1


def test_history_is_bounded_and_snapshots_are_independent():
    pool = make_pool(n_blocks=1000)
    pool.allocate("k", 16, owner=1)
    first = pool.history[-1]
    assert first.n_allocations == 1
    for _ in range(300):
        pool.allocate("k", 1, owner=2)
        pool.free_all(2)
    history = pool.history
    assert len(history) == 256
    assert first.n_allocations == 1  # untouched by later calls
    assert history[-1].n_frees == 300 and history[-1].n_allocations == 301
    history[-1].n_frees = -5
    assert pool.history[-1].n_frees == 300


def test_snapshot_is_detached():
    stats = AllocationStats(n_blocks=4, n_allocations=2)
    copy = stats.snapshot()
    stats.n_allocations = 3
    assert copy.n_allocations == 2 and copy == AllocationStats(n_blocks=4, n_allocations=2)


def test_to_prometheus_parses_and_reports_live_values():
    pool = make_pool(n_blocks=64)
    pool.allocate("k", 40, owner=1)
    pool.free_all(1)
    pool.allocate("k", 16, owner=2)
    text = pool.stats.to_prometheus()
    assert text.endswith("\n")
    samples = {
        s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
    }
    assert samples["veloxquant_block_pool_blocks_in_use"] == 1
    assert samples["veloxquant_block_pool_blocks_total"] == 64
    assert samples["veloxquant_block_pool_allocations_total"] == 4
    assert samples["veloxquant_block_pool_frees_total"] == 3
    assert samples["veloxquant_block_pool_reused_total"] == 1
    assert samples["veloxquant_block_pool_peak_blocks_in_use"] == 3
    for name in ("exhausted_total", "grown_total", "retired_total", "fragmentation"):
        assert samples[f"veloxquant_block_pool_{name}"] == 0
    custom = pool.stats.to_prometheus(prefix="x")
    assert "x_blocks_in_use 1" in custom


def test_history_entries_export_too():
    pool = make_pool()
    pool.allocate("k", 16, owner=1)
    text = pool.history[0].to_prometheus()
    assert "veloxquant_block_pool_allocations_total 1" in text


def test_blocks_held_by_owner_and_active_owners():
    pool = make_pool()
    pool.register_owner(9)
    pool.allocate("k", 32, owner=3)
    assert pool.active_owners() == [3, 9]
    assert pool.blocks_held_by_owner() == {3: 2}
    assert pool.n_blocks_held(3) == 2 and pool.n_blocks_held(9) == 0
