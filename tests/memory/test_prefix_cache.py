"""The pool's prefix cache on tiny pools: keys, references, LRU eviction, invariants.

One "layer" (two streams: its keys and its values) and block_size 4, so every
cached position is one k block and one v block and ids can be asserted exactly.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    ForeignBlockError,
    PoolArgumentError,
)
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.prefix_cache import (
    CACHED,
    PrefixCache,
    chain_hashes,
    prefix_root,
)

BS = 4
ROOT = prefix_root("model-a", "fp32", BS)


def make(n_blocks: int = 24) -> tuple[BlockPoolAllocator, PrefixCache]:
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks))
    return pool, pool.prefix_cache


def table(pool: BlockPoolAllocator, owner: int, positions: int):
    """An owner's one-layer table: [k blocks, v blocks], ``positions`` each."""
    return [pool.allocate("k", positions * BS, owner), pool.allocate("v", positions * BS, owner)]


def position(tab, j: int):
    return [stream[j] for stream in tab]


def check_invariants(pool: BlockPoolAllocator, cache: PrefixCache, live: set[int]) -> None:
    """Every block is free, cached, or held by a live owner; refs match references."""
    cached_ids = {b.block_id for e in cache.entries() for b in e.blocks}
    assert all(b.owner == CACHED for e in cache.entries() for b in e.blocks)
    held = pool.blocks_held_by_owner()
    assert set(held) <= live  # the cache is no owner
    for owner in held:  # the pool's per-stream counts follow transfers to the cache
        recount = Counter(b.stream for b in pool.blocks_for(owner))
        assert pool.n_blocks_held_per_stream(owner) == dict(recount)
    assert sum(held.values()) + len(cached_ids) == pool.stats.blocks_in_use()
    assert pool.n_free("k") + pool.n_free("v") + pool.stats.blocks_in_use() == pool.stats.n_blocks
    refs = {id(e): 0 for e in cache.entries()}
    for owner in live:
        counts: Counter[str] = Counter()
        for e in cache._held.get(owner, []):
            refs[id(e)] += 1
            counts.update(b.stream for b in e.blocks)
        assert cache.held_blocks(owner) == dict(counts)  # kept as references change
    assert set(cache._held_counts) <= live  # a released owner's counts go with it
    assert set(cache.holders()) <= live
    for e in cache.entries():
        assert e.refs == refs[id(e)]
        assert (e.key in cache._lru) == (e.refs == 0)
    evictable = sum(len(e.blocks) for e in cache.entries() if e.refs == 0)
    assert cache.evictable_blocks == evictable
    assert cache.cached_blocks == len(cached_ids)


def ended_chain(pool: BlockPoolAllocator, cache: PrefixCache, positions: int):
    """Owner 1 computes and publishes ``positions`` full blocks, then ends: its keys and
    its table (every position now cached and evictable)."""
    keys = chain_hashes(list(range(positions * BS)), BS, ROOT)
    tab = table(pool, 1, positions)
    for j, key in enumerate(keys):
        cache.publish(1, key, position(tab, j))
    cache.release(1)
    pool.free_all(1)
    return keys, tab


def test_keys_chain_and_depend_on_model_and_format():
    tokens = list(range(11))
    keys = chain_hashes(tokens, BS, ROOT)
    assert len(keys) == 2  # the partial last block has no key
    assert chain_hashes(tokens[:8], BS, ROOT) == keys
    assert chain_hashes(tokens[:4], BS, ROOT) == keys[:1]
    assert chain_hashes([0, 1, 2, 9] + tokens[4:], BS, ROOT)[1] != keys[1]  # parent differs
    other_model = chain_hashes(tokens, BS, prefix_root("model-b", "fp32", BS))
    other_format = chain_hashes(tokens, BS, prefix_root("model-a", "q4g64", BS))
    assert not set(keys) & set(other_model)
    assert not set(keys) & set(other_format)


def test_no_hit_across_models_or_formats():
    pool, cache = make()
    tokens = list(range(8))
    tab = table(pool, 1, 2)
    for j, key in enumerate(chain_hashes(tokens, BS, ROOT)):
        cache.publish(1, key, position(tab, j))
    assert len(cache.match(chain_hashes(tokens, BS, ROOT))) == 2
    for root in (prefix_root("model-b", "fp32", BS), prefix_root("model-a", "q8g64", BS)):
        assert cache.match(chain_hashes(tokens, BS, root)) == []


def test_publish_hands_blocks_to_the_pools_cache():
    pool, cache = make()
    tab = table(pool, 1, 3)
    in_use = pool.stats.blocks_in_use()
    keys = chain_hashes(list(range(12)), BS, ROOT)
    assert cache.publish(1, keys[0], position(tab, 0))
    assert cache.publish(1, keys[1], position(tab, 1))
    assert [b.block_id for e in cache.entries() for b in e.blocks] == [
        tab[0][0].block_id, tab[1][0].block_id, tab[0][1].block_id, tab[1][1].block_id]
    assert pool.active_owners() == [1] and set(pool.blocks_held_by_owner()) == {1}
    assert pool.n_blocks_held(1) == 2  # position 2 (the one being written) stays its own
    assert pool.stats.blocks_in_use() == in_use  # moved, not freed or allocated
    assert cache.cached_blocks == 4 and cache.evictable_blocks == 0
    assert cache.held_blocks(1) == {"k": 2, "v": 2}
    check_invariants(pool, cache, {1})


def test_duplicate_publish_keeps_the_first_and_leaves_the_copy_owned():
    pool, cache = make()
    key = chain_hashes(list(range(4)), BS, ROOT)[0]
    a, b = table(pool, 1, 1), table(pool, 2, 1)
    assert cache.publish(1, key, position(a, 0))
    assert not cache.publish(2, key, position(b, 0))
    assert pool.n_blocks_held(2) == 2 and cache.cached_blocks == 2
    pool.free_all(2)
    check_invariants(pool, cache, {1})


def test_publish_refuses_blocks_the_owner_does_not_hold():
    pool, cache = make()
    key = chain_hashes(list(range(4)), BS, ROOT)[0]
    tab = table(pool, 1, 1)
    with pytest.raises(PoolArgumentError):
        cache.publish(2, key, position(tab, 0))
    assert cache.cached_blocks == 0 and pool.n_blocks_held(1) == 2


def test_repeat_hits_whole_chain_and_partial_prefix_hits_its_head():
    pool, cache = make()
    first = list(range(12))
    keys = chain_hashes(first, BS, ROOT)
    tab = table(pool, 1, 3)
    for j, key in enumerate(keys):
        cache.publish(1, key, position(tab, j))
    cache.release(1)
    pool.free_all(1)
    assert len(cache.match(keys)) == 3
    shared_head = first[:5] + [99] * 7  # diverges inside block 1
    assert [e.key for e in cache.match(chain_hashes(shared_head, BS, ROOT))] == keys[:1]


def test_release_makes_entries_evictable_and_eviction_goes_tail_first():
    pool, cache = make()
    keys, tab = ended_chain(pool, cache, 3)
    assert cache.evictable("k") == 3 and cache.evictable("v") == 3
    free_k = pool.n_free("k")
    assert cache.evict({"k": 1}) == 2  # one position: its k and its v block
    assert pool.n_free("k") == free_k + 1
    assert [e.key for e in cache.match(keys)] == keys[:2]  # the tail went first
    assert cache.entries()[-1].blocks == position(tab, 1)
    check_invariants(pool, cache, set())
    assert cache.reset() == 4 and cache.cached_blocks == 0
    assert pool.stats.blocks_in_use() == 0
    assert cache.counters.evicted_blocks == 6


def test_eviction_never_touches_referenced_blocks():
    pool, cache = make()
    keys = chain_hashes(list(range(8)), BS, ROOT)
    tab = table(pool, 1, 2)
    for j, key in enumerate(keys):
        cache.publish(1, key, position(tab, j))
    cache.release(1)
    cache.acquire(2, cache.match(keys[:1]))  # a new request shares position 0
    assert cache.evict({"k": 10, "v": 10}) == 2  # only position 1 was evictable
    assert [e.key for e in cache.entries()] == keys[:1]
    assert cache.reset() == 0
    assert cache.entries()[0].blocks == position(tab, 0)
    check_invariants(pool, cache, {2})
    cache.release(2)
    assert cache.evictable_blocks == 2
    check_invariants(pool, cache, set())


def test_one_cache_per_pool_and_cached_blocks_are_nobodys():
    pool, cache = make()
    with pytest.raises(PoolArgumentError, match="pool.prefix_cache"):
        PrefixCache(pool)
    tab = table(pool, 1, 1)
    key = chain_hashes(list(range(4)), BS, ROOT)[0]
    cache.publish(1, key, position(tab, 0))
    with pytest.raises(PoolArgumentError, match="prefix cache"):
        pool.transfer(position(tab, 0), 2)  # no owner takes a cached block
    pool.free(position(tab, 0))  # nor frees it: a no-op, as for a free block
    assert cache.cached_blocks == 2 and pool.stats.blocks_in_use() == 2
    with pytest.raises(PoolArgumentError):
        pool.allocate("k", 1, CACHED)  # the cache's mark is no owner id
    other = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=4))
    with pytest.raises(ForeignBlockError):
        cache.publish(1, b"x" * 32, other.allocate("k", 1, 1))


def test_allocation_evicts_unreferenced_blocks_before_it_refuses():
    """Evictable blocks are counted once: as available, and taken by allocation."""
    pool, cache = make(n_blocks=8)  # 4 k + 4 v
    keys, tab = ended_chain(pool, cache, 3)
    assert pool.n_free("k") == 1 and cache.evictable("k") == 3
    assert pool.n_available("k") == 4 and pool.n_available("kv") == 8
    frees = pool.stats.n_frees
    got = pool.allocate("k", 3 * BS, 2)  # 1 free + 2 evicted, the chain's tail first
    assert len(got) == 3 and pool.n_available("k") == 1
    assert [e.key for e in cache.match(keys)] == keys[:1]
    assert pool.stats.n_frees == frees + 4  # two positions: their k and v blocks
    assert pool.stats.blocks_in_use() == pool.stats.n_allocations - pool.stats.n_frees
    check_invariants(pool, cache, {2})
    cache.acquire(3, cache.match(keys[:1]))  # referenced: never evicted
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 2 * BS, 2)
    assert len(cache.match(keys)) == 1
    check_invariants(pool, cache, {2, 3})


def test_random_mix_of_requests_cancels_and_evictions_keeps_every_block_accounted():
    rng = random.Random(13)
    pool, cache = make(n_blocks=80)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 20))] for _ in range(12)]
    live: dict[int, list] = {}
    next_owner = 1
    for _ in range(400):
        op = rng.random()
        if op < 0.45 and len(live) < 5:
            owner, next_owner = next_owner, next_owner + 1
            prompt = rng.choice(prompts)
            keys = chain_hashes(prompt, BS, ROOT)
            hit = cache.match(keys[: (len(prompt) - 1) // BS])
            need = -(-len(prompt) // BS) - len(hit)
            pinned = sum(1 for e in hit if e.refs == 0)  # it stops being evictable
            if need > min(pool.n_available("k"), pool.n_available("v")) - pinned:
                continue
            cache.acquire(owner, hit)
            if rng.random() < 0.5:  # else the allocations below evict what they need
                cache.evict({"k": need - pool.n_free("k"), "v": need - pool.n_free("v")})
            own = table(pool, owner, need)
            tab = [[e.blocks[s] for e in hit] + own[s] for s in range(2)]
            live[owner] = [keys, len(hit), tab]
        elif op < 0.75 and live:  # prefill done: publish the full prompt blocks
            owner = rng.choice(list(live))
            keys, shared, tab = live[owner]
            for j in range(shared, len(keys)):
                cache.publish(owner, keys[j], position(tab, j))
        elif op < 0.95 and live:  # finished or cancelled, published or not
            owner = rng.choice(list(live))
            del live[owner]
            pool.free_all(owner)
            cache.release(owner)
        else:
            cache.evict({"k": rng.randrange(4), "v": rng.randrange(4)})
        check_invariants(pool, cache, set(live))
    for owner in list(live):
        pool.free_all(owner)
        cache.release(owner)
    check_invariants(pool, cache, set())
    assert cache.evictable_blocks == cache.cached_blocks
    assert pool.stats.blocks_in_use() == cache.cached_blocks
    cache.reset()
    assert pool.stats.blocks_in_use() == 0 and pool.n_free("k") + pool.n_free("v") == 80
