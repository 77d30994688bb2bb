"""PoolBackedBatchKVCache: bookkeeping against the arrays, mlx-lm's batch contract, tokens.

The reference for the batch protocol is mlx-lm's own ``BatchKVCache``: the
same operations on both must give the same arrays, offsets and padding. The
reference for the pool is arithmetic: after any sequence of joins, decode
steps and leaves, every owner holds exactly ``2 * layers * ceil(tokens / bs)``
blocks with exact ``n_used``, and a row's extracted keys are exactly what
was appended for that owner.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from veloxquant_mlx.exceptions import BlockPoolExhaustedError, VeloxQuantError
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig, build_pooled_caches
from veloxquant_mlx.memory.pool_backed_batch import PoolBackedBatchKVCache, make_batch_caches

BS = 16
H, D = 2, 8


@runtime_checkable
class BatchCacheContract(Protocol):
    """What mlx-lm's batch generation asks of a per-layer cache."""

    offset: Any
    left_padding: Any

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...
    def make_mask(self, N: int, return_array: bool = False, **kwargs) -> Any: ...
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None: ...
    def finalize(self) -> None: ...
    def filter(self, batch_indices) -> None: ...
    def extend(self, other) -> None: ...
    def extract(self, idx: int) -> Any: ...
    def trim(self, n: int) -> int: ...
    def size(self) -> int: ...
    def empty(self) -> bool: ...


def kv(rng: random.Random, rows: int, n: int) -> tuple[mx.array, mx.array]:
    key = mx.random.key(rng.randrange(2**31))
    k1, k2 = mx.random.split(key)
    return (mx.random.normal((rows, H, n, D), key=k1), mx.random.normal((rows, H, n, D), key=k2))


def test_both_classes_meet_the_contract():
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=64))
    assert isinstance(PoolBackedBatchKVCache(pool, [1]), BatchCacheContract)
    assert isinstance(BatchKVCache([0]), BatchCacheContract)


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b))


def _prefilled(cls_pair, pool, owner, rng, n):
    ours = PoolBackedBatchKVCache(pool, [owner])
    ref = BatchKVCache([0])
    k, v = kv(rng, 1, n)
    ours.update_and_fetch(k, v)
    ref.update_and_fetch(k, v)
    return ours, ref


def test_same_arrays_as_mlx_lm_batch_cache_through_joins_steps_leaves():
    rng = random.Random(3)
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=4096))
    ours, ref = _prefilled(None, pool, 1, rng, 5)
    owner = 2
    for step in range(60):
        op = rng.random()
        if op < 0.15 or not ours.rows:
            o, r = _prefilled(None, pool, owner, rng, rng.randrange(1, 40))
            owner += 1
            if ours.rows:
                ours.extend(o)
                ref.extend(r)
            else:
                ours, ref = o, r
        elif op < 0.25 and len(ours.rows) > 1:
            keep = sorted(rng.sample(range(len(ours.rows)), rng.randrange(1, len(ours.rows))))
            ours.filter(keep)
            ref.filter(mx.array(keep))
        k, v = kv(rng, len(ours.rows), 1)
        ko, vo = ours.update_and_fetch(k, v)
        kr, vr = ref.update_and_fetch(k, v)
        assert _same(ko, kr) and _same(vo, vr), step
        assert ours.offset.tolist() == ref.offset.tolist()
        assert ours.left_padding.tolist() == ref.left_padding.tolist()
        if any(ours.left_padding.tolist()):
            assert _same(ours.make_mask(1), ref.make_mask(1))
            assert _same(ours.make_mask(3), ref.make_mask(3))
        i = rng.randrange(len(ours.rows))
        assert _same(ours.extract(i).state[0], ref.extract(i).state[0])


def test_prepare_finalize_right_padding_matches_mlx_lm():
    rng = random.Random(5)
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=256))
    ours, ref = PoolBackedBatchKVCache(pool, [1, 2, 3]), BatchKVCache([0, 0, 0])
    lengths = [7, 3, 5]
    pad = [max(lengths) - n for n in lengths]
    for c in (ours, ref):
        c.prepare(lengths=lengths, right_padding=pad)
    k, v = kv(rng, 3, max(lengths))
    ours.update_and_fetch(k, v)
    ref.update_and_fetch(k, v)
    assert _same(ours.make_mask(7, return_array=True), ref.make_mask(7, return_array=True))
    assert [ours.real_tokens(i) for i in range(3)] == lengths
    ours.finalize()
    ref.finalize()
    assert _same(ours.keys_and_values()[0], ref.keys_and_values()[0])
    assert ours.left_padding.tolist() == ref.left_padding.tolist() == pad
    assert ours.offset.tolist() == ref.offset.tolist() == lengths
    assert [r.tokens for r in ours.rows] == lengths
    assert pool.stats.blocks_in_use() == 6  # one k and one v block per row


def check_books(pool: BlockPoolAllocator, layers: list[PoolBackedBatchKVCache],
                appended: dict[int, list[mx.array]]) -> None:
    """The pool's view, every row's view and the arrays agree exactly."""
    held = pool.blocks_held_by_owner()
    owners = layers[0].owners
    assert set(held) == set(owners)
    for i, owner in enumerate(owners):
        tokens = sum(a.shape[2] for a in appended[owner])
        blocks = -(-tokens // BS)
        assert held[owner] == 2 * len(layers) * blocks, owner
        for layer in layers:
            row = layer.rows[i]
            assert row.owner == owner and row.tokens == tokens == layer.real_tokens(i)
            used = [b.n_used for b in row.k]
            assert used == [min(BS, tokens - j * BS) for j in range(blocks)]
            assert used == [b.n_used for b in row.v]
            assert all(b.owner == owner for b in row.k + row.v)
        got = layers[0].extract(i).state[0]
        assert _same(got, mx.concatenate(appended[owner], axis=2)), owner
    assert pool.stats.blocks_in_use() == sum(held.values())


def test_random_joins_and_leaves_never_drift():
    rng = random.Random(11)
    n_layers = 3
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=8192))
    batch: list[PoolBackedBatchKVCache] | None = None
    appended: dict[int, list[mx.array]] = {}
    next_owner = 1
    for _ in range(80):
        r = rng.random()
        if batch is None or (r < 0.2 and len(batch[0].rows) < 8):
            owner, next_owner = next_owner, next_owner + 1
            single = [PoolBackedBatchKVCache(pool, [owner]) for _ in range(n_layers)]
            k, v = kv(rng, 1, rng.randrange(1, 50))
            for layer in single:
                layer.update_and_fetch(k, v)
            appended[owner] = [k]
            if batch is None:
                batch = single
            else:
                for b, s in zip(batch, single, strict=True):
                    b.extend(s)
                assert single[0].rows == [] and single[0].n_blocks_held() == 0
        elif r < 0.35 and len(batch[0].rows) > 1:
            rows = len(batch[0].rows)
            keep = sorted(rng.sample(range(rows), rng.randrange(1, rows)))
            for layer in batch:
                layer.filter(keep)
        k, v = kv(rng, len(batch[0].rows), 1)
        for layer in batch:
            layer.update_and_fetch(k, v)
        for i, owner in enumerate(batch[0].owners):
            appended[owner].append(k[i: i + 1])
        check_books(pool, batch, appended)
    for layer in batch:
        layer.filter([])
    assert pool.stats.blocks_in_use() == 0


def test_exhausted_growth_changes_nothing():
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=6))
    rng = random.Random(1)
    a = PoolBackedBatchKVCache(pool, [1])
    a.update_and_fetch(*kv(rng, 1, 16))
    b = PoolBackedBatchKVCache(pool, [2])
    b.update_and_fetch(*kv(rng, 1, 16 * 2))
    a.extend(b)  # holds 2 + 4 = all 6 blocks; both rows' last blocks are full
    before = (pool.stats.blocks_in_use(), a.size(), a.offset.tolist())
    with pytest.raises(BlockPoolExhaustedError):
        a.update_and_fetch(*kv(rng, 2, 1))
    assert (pool.stats.blocks_in_use(), a.size(), a.offset.tolist()) == before
    assert [r.tokens for r in a.rows] == [16, 32]
    a.filter([1])
    assert pool.stats.blocks_in_use() == 4
    a.update_and_fetch(*kv(rng, 1, 1))  # row 0's blocks came back: row 2 grows now
    assert pool.n_blocks_held(2) == 6


def test_filter_during_a_left_padded_prefill_keeps_the_survivors_tokens():
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=64))
    rng = random.Random(4)
    c = PoolBackedBatchKVCache(pool, [1, 2], left_padding=[0, 5])
    k1, v1 = kv(rng, 2, 3)  # row 2 is still all padding after these 3 columns
    c.update_and_fetch(k1, v1)
    assert [c.real_tokens(0), c.real_tokens(1)] == [3, 0] and pool.n_blocks_held(2) == 0
    c.filter([1])
    assert c.size() == 0 and c.left_padding.tolist() == [2] and pool.n_blocks_held(1) == 0
    k2, v2 = kv(rng, 1, 4)
    c.update_and_fetch(k2, v2)
    assert c.offset.tolist() == [2] and c.rows[0].tokens == 2 and pool.n_blocks_held(2) == 2
    assert _same(c.extract(0).state[0], k2[:, :, 2:])
    c.release()
    assert pool.stats.blocks_in_use() == 0


def test_trim_frees_surplus_and_misuse_raises():
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=64))
    rng = random.Random(2)
    c = PoolBackedBatchKVCache(pool, [1])
    c.update_and_fetch(*kv(rng, 1, 40))
    assert pool.n_blocks_held(1) == 6
    assert c.trim(20) == 20
    assert pool.n_blocks_held(1) == 4 and c.rows[0].tokens == 20
    assert [b.n_used for b in c.rows[0].k] == [16, 4]
    other_pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=8))
    with pytest.raises(VeloxQuantError, match="same pool"):
        c.extend(PoolBackedBatchKVCache(other_pool, [9]))
    with pytest.raises(VeloxQuantError):
        c.extend(KVCache())
    with pytest.raises(ValueError, match="left_padding"):
        PoolBackedBatchKVCache(pool, [1, 2], left_padding=[0])
    merged = PoolBackedBatchKVCache.merge([c])
    assert merged.owners == [1] and c.rows == []
    merged.release()
    assert pool.stats.blocks_in_use() == 0


def _greedy_alone(model, pool, prompt: list[int], owner: int, n: int):
    caches = build_pooled_caches(model, pool, owner)
    logits = model(mx.array(prompt)[None], cache=caches)[:, -1]
    out, rows = [], []
    for _ in range(n):
        rows.append(logits[0])
        token = mx.argmax(logits, axis=-1)
        out.append(token.item())
        logits = model(token[:, None], cache=caches)[:, -1]
    caches[0].release()
    return out, rows


def test_batch_of_eight_gives_each_request_its_tokens_alone(tiny_model):
    """Greedy tokens in a batch of 8 (rows joining mid-decode) == each alone.

    Measured: the logits are bit-identical (max |diff| 0.0) on the tiny model
    (and on the small one, bundled BLAS and OpenBLAS); the bound below only
    allows float32 last-bit noise should a BLAS split batched matmuls otherwise.
    """
    model, _ = tiny_model
    rng = random.Random(7)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    n = 24
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=8192))
    alone = [_greedy_alone(model, pool, p, i + 1, n) for i, p in enumerate(prompts)]
    assert pool.stats.blocks_in_use() == 0
    batch, inputs = None, None
    outs: list[list[int]] = []
    logit_rows: list[list[mx.array]] = []
    for i, prompt in enumerate(prompts):  # one joins after every decode step
        single = make_batch_caches(model, pool, 100 + i)
        logits = model(mx.array(prompt)[None], cache=single)[:, -1]
        first = mx.argmax(logits, axis=-1)
        outs.append([first.item()])
        logit_rows.append([logits[0]])
        if batch is None:
            batch, inputs = single, first
        else:
            for b, s in zip(batch, single, strict=True):
                b.extend(s)
            inputs = mx.concatenate([inputs, first])
        logits = model(inputs[:, None], cache=batch)[:, -1]
        inputs = mx.argmax(logits, axis=-1)
        for row, (out, token) in enumerate(zip(outs, inputs.tolist(), strict=True)):
            if len(out) < n:
                out.append(token)
                logit_rows[row].append(logits[row])
    while any(len(o) < n for o in outs):
        logits = model(inputs[:, None], cache=batch)[:, -1]
        inputs = mx.argmax(logits, axis=-1)
        for row, (out, token) in enumerate(zip(outs, inputs.tolist(), strict=True)):
            if len(out) < n:
                out.append(token)
                logit_rows[row].append(logits[row])
    worst = 0.0
    for (tokens, ref_rows), out, rows in zip(alone, outs, logit_rows, strict=True):
        assert out == tokens
        diffs = (float(mx.abs(a - b).max()) for a, b in zip(ref_rows, rows, strict=True))
        worst = max(worst, *diffs)
    assert worst <= 1e-4, worst
    for layer in batch:
        layer.release()
    assert pool.stats.blocks_in_use() == 0


def test_left_padded_group_prefill_matches_single_prefill(tiny_model):
    """Eight prompts of different lengths prefilled in one call (left-padded).

    Measured: bit-identical last-position logits on the tiny model; on the
    small model with OpenBLAS they differ by up to ~4e-6 (the bigger GEMM
    splits its sums differently), argmax unchanged.
    """
    model, _ = tiny_model
    rng = random.Random(9)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=8192))
    singles = []
    for i, p in enumerate(prompts):
        caches = make_batch_caches(model, pool, 50 + i)
        singles.append(model(mx.array(p)[None], cache=caches)[0, -1])
        for layer in caches:  # each layer holds its own blocks
            layer.release()
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    group = make_batch_caches(model, pool, list(range(1, 9)), pads)
    x = mx.array([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])
    logits = model(x, cache=group)[:, -1]
    worst = max(float(mx.abs(logits[i] - singles[i]).max()) for i in range(8))
    assert worst <= 1e-4, worst
    for i, p in enumerate(prompts):  # padding is never accounted
        assert pool.n_blocks_held(i + 1) == 2 * len(model.layers) * -(-len(p) // BS)
    for layer in group:
        layer.release()
    assert pool.stats.blocks_in_use() == 0
