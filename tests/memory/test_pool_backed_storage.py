"""PoolBackedKVCache over the pool's block storage: a request's KV in pool blocks only.

The caches ``build_pooled_caches(model, pool, owner, storage=arena)`` returns
are what the server builds for every request. Used alone they keep mlx-lm's
KVCache contract (the very logits of the stock cache, through
``mlx_lm.generate`` too); batched, ``make_batch_caches`` runs them in one
call; and ``release()`` on any layer gives every block back and retires the owner.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.exceptions import (
    BlockPoolExhaustedError,
    CacheReleasedError,
    PoolArgumentError,
    VeloxQuantError,
)
from veloxquant_mlx.memory import (
    BlockPoolAllocator,
    PoolBackedKVCache,
    PoolConfig,
    build_pooled_caches,
    make_batch_caches,
)
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout

BS = 16
PROMPT = [5 + (7 * j) % 250 for j in range(37)]


def _arena(model, n_blocks: int = 512) -> KVArena:
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks))
    return KVArena(pool, probe_kv_layout(model))


def _logits(model, cache, prompt, steps):
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, -1)[:, None], cache=cache)[:, -1]
        out.append(logits)
    return out


@pytest.mark.parametrize("which", ["model", "served_model"])
def test_alone_it_gives_the_stock_caches_logits_bit_for_bit(request, which):
    model = request.getfixturevalue(which)
    arena = _arena(model)
    caches = build_pooled_caches(model, arena.pool, owner=7, storage=arena)
    assert all(type(c) is PoolBackedKVCache and c.owner == 7 for c in caches)
    ours = _logits(model, caches, PROMPT, 20)
    stock = _logits(model, make_prompt_cache(model), PROMPT, 20)
    for a, b in zip(ours, stock, strict=True):
        assert mx.array_equal(a, b).item()
    assert caches[0].offset.tolist() == [len(PROMPT) + 20]
    assert caches[3].size() == len(PROMPT) + 20
    caches[0].release()


def test_its_blocks_are_exactly_its_tokens_and_release_retires_the_owner(model):
    arena = _arena(model)
    pool, layers = arena.pool, len(model.layers)
    caches = build_pooled_caches(model, pool, owner=3, storage=arena)
    assert caches[0].empty() and caches[0].n_blocks_held() == 0
    _logits(model, caches, PROMPT, 11)  # 48 tokens: 3 blocks per layer and stream
    assert pool.n_blocks_held(3) == 2 * layers * 3
    assert all(c.n_blocks_held() == 6 for c in caches)
    assert sorted(b.n_used for b in pool.blocks_for(3))[:2 * layers] == [BS] * (2 * layers)
    assert caches[1].nbytes == 6 * arena.layout.bytes_per_block(BS)
    caches[2].release()  # any layer releases the request
    assert pool.stats.blocks_in_use() == 0 and 3 not in pool.active_owners()
    assert pool.stats.n_allocations == pool.stats.n_frees
    assert all(c.released and c.n_blocks_held() == 0 for c in caches)
    caches[0].release()  # twice is harmless
    with pytest.raises(CacheReleasedError):
        caches[0].update_and_fetch(mx.zeros((1, 2, 1, 32)), mx.zeros((1, 2, 1, 32)))


def test_state_is_the_stored_keys_and_values(model):
    arena = _arena(model)
    ours = build_pooled_caches(model, arena.pool, owner=1, storage=arena)
    stock = make_prompt_cache(model)
    _logits(model, ours, PROMPT, 3)
    _logits(model, stock, PROMPT, 3)
    for a, b in zip(ours, stock, strict=True):
        keys, values, offset = a.state
        assert offset == b.offset  # the stock state may keep its buffer's spare columns
        assert mx.array_equal(keys, b.state[0][..., :offset, :]).item()
        assert mx.array_equal(values, b.state[1][..., :offset, :]).item()
    with pytest.raises(VeloxQuantError, match="load_pooled_prompt_cache"):
        ours[0].state = stock[0].state
    assert not ours[0].is_trimmable() and ours[0].trim(4) == 0


def test_generate_through_mlx_lm_matches_the_stock_cache(tiny_model):
    model, tokenizer = tiny_model
    arena = _arena(model)
    caches = build_pooled_caches(model, arena.pool, owner=1, storage=arena)
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=12, prompt_cache=caches)
    assert text == mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=12)
    assert arena.pool.n_blocks_held(1) > 0
    caches[0].release()
    assert arena.pool.stats.blocks_in_use() == 0


def test_exhaustion_changes_nothing_and_the_request_goes_on_after_room_is_made(model):
    layers = len(model.layers)
    arena = _arena(model, n_blocks=2 * layers * 2)  # 2 blocks per layer and stream
    pool = arena.pool
    caches = build_pooled_caches(model, pool, owner=1, storage=arena)
    _logits(model, caches, PROMPT[:20], 0)  # 2 blocks each: the pool is full
    hog = build_pooled_caches(model, pool, owner=2, storage=arena)
    with pytest.raises(BlockPoolExhaustedError):
        _logits(model, hog, PROMPT[:4], 0)
    assert pool.n_blocks_held(2) == 0 and hog[0].size() == 0
    caches[0].release()
    ours = _logits(model, hog, PROMPT[:4], 2)  # the same caches run once room is back
    stock = _logits(model, make_prompt_cache(model), PROMPT[:4], 2)
    assert all(mx.array_equal(a, b).item() for a, b in zip(ours, stock, strict=True))


def test_requests_batch_over_their_caches_and_each_release_frees_its_own(served_model):
    model = served_model
    arena = _arena(model)
    pool = arena.pool
    requests = [build_pooled_caches(model, pool, owner, storage=arena) for owner in (1, 2)]
    prompts = [PROMPT[:30], PROMPT[:21]]
    batch = make_batch_caches(model, arena, requests, left_padding=[0, 9], fast_attention=False)
    logits = model(mx.array([prompts[0], [0] * 9 + prompts[1]]), cache=batch.caches)[:, -1]
    assert [c[0].size() for c in requests] == [30, 21]
    for i, prompt in enumerate(prompts):  # each row: its own prompt's logits alone
        alone = _logits(model, make_prompt_cache(model), prompt, 0)[0]
        assert mx.allclose(logits[i:i + 1], alone, atol=1e-5).item()
    batch.filter([1])  # row 0 leaves the batch: its blocks go back, owner 2 keeps its own
    requests[0][0].release()
    assert pool.n_blocks_held(1) == 0 and pool.n_blocks_held(2) == 2 * len(model.layers) * 2
    requests[1][0].release()
    assert pool.stats.blocks_in_use() == 0


def test_bad_uses_are_refused_with_typed_errors(model):
    arena = _arena(model)
    other = _arena(model)
    with pytest.raises(ValueError, match="another pool"):
        build_pooled_caches(model, arena.pool, 1, storage=other)
    caches = build_pooled_caches(model, arena.pool, 1, storage=arena)
    with pytest.raises(PoolArgumentError, match="one sequence"):
        caches[0].update_and_fetch(mx.zeros((2, 2, 1, 32)), mx.zeros((2, 2, 1, 32)))
    with pytest.raises(ValueError, match="owner id or the caches"):
        make_batch_caches(model, other, [caches])
    assert arena.pool.stats.n_allocations == 0
