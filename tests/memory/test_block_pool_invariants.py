"""Invariants of the allocator under random operation sequences and under threads."""

from __future__ import annotations

import random
import threading
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from veloxquant_mlx.memory import BlockPoolAllocator, BlockPoolExhaustedError, PoolConfig


def check_invariants(pool: BlockPoolAllocator) -> None:
    """Recount everything from the blocks themselves and compare with the counters."""
    stats = pool.snapshot()
    owned_ids: list[int] = []
    for owner, held in pool.blocks_held_by_owner().items():
        blocks = pool.blocks_for(owner)
        assert len(blocks) == held
        assert all(b.owner == owner for b in blocks)
        assert pool.n_blocks_held_per_stream(owner) == dict(Counter(b.stream for b in blocks))
        owned_ids.extend(b.block_id for b in blocks)
    free_ids = [b.block_id for stream in pool._streams.values() for b in stream.stack]
    assert all(pool._blocks[i].owner is None for i in free_ids)
    # free xor owned by exactly one owner
    assert len(set(owned_ids)) == len(owned_ids)
    assert not set(owned_ids) & set(free_ids) and len(set(free_ids)) == len(free_ids)
    assert set(owned_ids) | set(free_ids) == set(pool._blocks)
    assert stats.blocks_in_use() == len(owned_ids) == stats.n_allocations - stats.n_frees
    assert 0 <= stats.blocks_in_use() <= stats.n_blocks == len(pool._blocks)
    # every id ever created is free, in use or retired
    assert pool._next_id == len(free_ids) + len(owned_ids) + stats.n_retired
    bs = pool.config.block_size
    partial = sum(1 for i in owned_ids if pool._blocks[i].n_used < bs)
    assert stats.n_partial == partial
    fresh = sum(1 for i in free_ids if not pool._blocks[i].ever_allocated)
    assert fresh == sum(stream.n_fresh for stream in pool._streams.values())
    for stream in pool._streams.values():  # the never-allocated run sits at the bottom
        assert not any(b.ever_allocated for b in stream.stack[: stream.n_fresh])
    assert stats.peak_blocks_in_use >= stats.blocks_in_use()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/free/shrink/grow sequences against a recounted model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPoolAllocator | None = None
        self.expected_in_use: dict[int, int] = {}

    @precondition(lambda self: self.pool is None)
    @rule(
        n_blocks=st.integers(1, 12),
        separate=st.booleans(),
        grow=st.booleans(),
        extra=st.one_of(st.none(), st.integers(0, 6)),
    )
    def make(self, n_blocks, separate, grow, extra):
        max_blocks = None if extra is None else n_blocks + extra
        self.pool = BlockPoolAllocator(
            PoolConfig(block_size=4, n_blocks=n_blocks, separate_kv=separate,
                       grow_on_exhaustion=grow, max_blocks=max_blocks)
        )

    @precondition(lambda self: self.pool is not None)
    @rule(owner=st.integers(0, 5), n_tokens=st.integers(1, 20), stream=st.sampled_from("kv"))
    def allocate(self, owner, n_tokens, stream):
        before = self.pool.snapshot()
        try:
            blocks = self.pool.allocate(stream, n_tokens, owner)
        except BlockPoolExhaustedError:
            after = self.pool.snapshot()
            assert after.n_exhausted == before.n_exhausted + 1  # one failed call
            assert after.n_allocations == before.n_allocations
            return
        assert len(blocks) == -(-n_tokens // 4)
        assert sum(b.n_used for b in blocks) == n_tokens
        self.expected_in_use[owner] = self.expected_in_use.get(owner, 0) + len(blocks)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=st.integers(0, 5))
    def free_all(self, owner):
        self.pool.free_all(owner)
        self.expected_in_use.pop(owner, None)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=st.integers(0, 5), data=st.data())
    def free_some(self, owner, data):
        blocks = self.pool.blocks_for(owner)
        if not blocks:
            return
        chosen = data.draw(st.lists(st.sampled_from(blocks), max_size=len(blocks)))
        self.pool.free(chosen)
        self.expected_in_use[owner] -= len({b.block_id for b in chosen})
        if not self.expected_in_use[owner]:
            del self.expected_in_use[owner]

    @precondition(lambda self: self.pool is not None)
    @rule(owner=st.integers(0, 5), data=st.data())
    def write(self, owner, data):
        for block in self.pool.blocks_for(owner):
            block.n_used = data.draw(st.integers(0, 4))

    @precondition(lambda self: self.pool is not None)
    @rule(stream=st.sampled_from(["k", "v", "kv"]), target_free=st.integers(0, 4))
    def shrink(self, stream, target_free):
        in_use = self.pool.stats.blocks_in_use()
        self.pool.shrink(stream, target_free)
        assert self.pool.stats.blocks_in_use() == in_use

    @invariant()
    def consistent(self):
        if self.pool is None:
            return
        check_invariants(self.pool)
        assert self.pool.blocks_held_by_owner() == self.expected_in_use


TestPoolMachine = PoolMachine.TestCase
# No deadline and no too-slow check: CI machines are shared, and timing is not what this tests.
TestPoolMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_threads_never_share_a_block():
    """8 threads allocate and free for their own owners; no block goes to two owners."""
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=64))
    errors: list[BaseException] = []
    seen_twice = threading.Event()

    def worker(owner: int) -> None:
        rng = random.Random(owner)
        try:
            for _ in range(400):
                try:
                    blocks = pool.allocate(rng.choice("kv"), rng.randint(1, 48), owner)
                except BlockPoolExhaustedError:
                    pool.free_all(owner)
                    continue
                if any(b.owner != owner for b in blocks):
                    seen_twice.set()
                if rng.random() < 0.3:
                    pool.free(blocks[:1])
                if rng.random() < 0.2:
                    pool.free_all(owner)
            pool.free_all(owner)
        except BaseException as exc:  # surfaced below: threads swallow errors otherwise
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not seen_twice.is_set()
    check_invariants(pool)
    assert pool.stats.blocks_in_use() == 0 and pool.n_free("kv") == 64


def test_shrink_racing_with_allocations_keeps_invariants():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=400))
    stop = threading.Event()
    retired: list[int] = []

    def shrinker() -> None:
        target = 200
        while not stop.is_set() and target > 0:
            retired.append(pool.shrink("kv", target))
            target -= 10

    def allocator(owner: int) -> None:
        rng = random.Random(owner)
        for _ in range(300):
            try:
                held = pool.allocate(rng.choice("kv"), rng.randint(1, 64), owner)
                assert all(b.owner == owner for b in held)
            except BlockPoolExhaustedError:
                pass
            if rng.random() < 0.5:
                pool.free_all(owner)

    workers = [threading.Thread(target=allocator, args=(i,)) for i in range(4)]
    s = threading.Thread(target=shrinker)
    for t in (*workers, s):
        t.start()
    for t in workers:
        t.join(timeout=60)
    stop.set()
    s.join(timeout=60)
    check_invariants(pool)
    assert pool.stats.n_retired == sum(retired) > 0
    for owner in range(4):
        pool.free_all(owner)
    check_invariants(pool)
    assert pool.stats.blocks_in_use() == 0
