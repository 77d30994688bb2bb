"""PoolBackedKVCache driving real mlx-lm generation on the offline tiny model."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from veloxquant_mlx.memory import (
    BlockPoolAllocator,
    PoolBackedKVCache,
    PoolConfig,
    build_pooled_caches,
    load_pooled_prompt_cache,
)

PROMPT = "Return the number of items in a container, or raise an error."
MAX_TOKENS = 60


def greedy_tokens(model, tokenizer, prompt, cache, max_tokens=MAX_TOKENS) -> list[int]:
    return [
        r.token
        for r in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache
        )
    ]


@pytest.fixture(scope="module")
def prompt_ids(tiny_model) -> list[int]:
    _, tokenizer = tiny_model
    return tokenizer.encode(PROMPT * 3)


@pytest.fixture(scope="module")
def stock_tokens(tiny_model, prompt_ids) -> list[int]:
    model, tokenizer = tiny_model
    return greedy_tokens(model, tokenizer, prompt_ids, make_prompt_cache(model))


def test_generation_matches_stock_and_second_request_reuses_blocks(
    tiny_model, prompt_ids, stock_tokens
):
    model, tokenizer = tiny_model
    n_layers = len(model.layers)
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4096))

    cache_a = build_pooled_caches(model, pool, owner=1)
    assert greedy_tokens(model, tokenizer, prompt_ids, cache_a) == stock_tokens
    assert len(stock_tokens) == MAX_TOKENS
    blocks = -(-cache_a[0].offset // 16)
    assert pool.stats.blocks_in_use() == 2 * n_layers * blocks
    assert pool.stats.n_reused == 0
    cache_a[-1].release()
    assert pool.stats.blocks_in_use() == 0

    before = pool.stats.snapshot()
    cache_b = build_pooled_caches(model, pool, owner=2)
    assert greedy_tokens(model, tokenizer, prompt_ids, cache_b) == stock_tokens
    b_allocations = pool.stats.n_allocations - before.n_allocations
    assert b_allocations == 2 * n_layers * blocks
    assert pool.stats.n_reused - before.n_reused == b_allocations
    cache_b[0].release()
    cache_a[0].release()  # stale release from the finished request: no effect
    assert pool.stats.blocks_in_use() == 0
    assert pool.stats.n_frees == pool.stats.n_allocations


def test_generate_text_matches_stock(tiny_model):
    model, tokenizer = tiny_model
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=1024))
    messages = [{"role": "user", "content": "Say something."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    stock = mlx_lm.generate(model, tokenizer, prompt, max_tokens=24)
    pooled = mlx_lm.generate(
        model, tokenizer, prompt, max_tokens=24,
        prompt_cache=build_pooled_caches(model, pool, owner=3),
    )
    assert pooled == stock


def test_save_and_load_round_trip_continues_like_stock(tiny_model, prompt_ids, tmp_path):
    model, tokenizer = tiny_model
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4096))
    pooled = build_pooled_caches(model, pool, owner=1)
    stock = make_prompt_cache(model)
    greedy_tokens(model, tokenizer, prompt_ids, pooled, max_tokens=10)
    greedy_tokens(model, tokenizer, prompt_ids, stock, max_tokens=10)
    path = str(tmp_path / "pooled.safetensors")
    save_prompt_cache(path, pooled, metadata={"note": "hi"})
    pooled[0].release()

    # mlx-lm's own loader gives detached caches with the saved state.
    plain = load_prompt_cache(path)
    assert [type(c) for c in plain] == [PoolBackedKVCache] * len(model.layers)
    assert all(c.pool is None and c.offset == stock[0].offset for c in plain)

    loaded, meta = load_pooled_prompt_cache(path, pool, owner=2, return_metadata=True)
    assert meta == {"note": "hi"}
    blocks = -(-loaded[0].offset // 16)
    assert pool.stats.blocks_in_use() == 2 * len(model.layers) * blocks
    follow_up = tokenizer.encode(" and then")
    assert greedy_tokens(model, tokenizer, follow_up, loaded, 20) == greedy_tokens(
        model, tokenizer, follow_up, stock, 20
    )
    loaded[3].release()
    assert pool.stats.blocks_in_use() == 0


def test_stock_cache_file_loads_into_pooled_caches(tiny_model, prompt_ids, tmp_path):
    model, tokenizer = tiny_model
    stock = make_prompt_cache(model)
    greedy_tokens(model, tokenizer, prompt_ids, stock, max_tokens=5)
    path = str(tmp_path / "stock.safetensors")
    save_prompt_cache(path, stock)
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4096))
    loaded = load_pooled_prompt_cache(path, pool, owner=4)
    assert [c.offset for c in loaded] == [c.offset for c in stock]
    for mine, theirs in zip(loaded, stock, strict=True):
        assert mx.array_equal(mine.state[0], theirs.state[0][..., : theirs.offset, :]).item()


def test_loading_more_than_the_pool_holds_leaves_nothing_allocated(
    tiny_model, prompt_ids, tmp_path
):
    model, tokenizer = tiny_model
    stock = make_prompt_cache(model)
    greedy_tokens(model, tokenizer, prompt_ids, stock, max_tokens=5)
    path = str(tmp_path / "big.safetensors")
    save_prompt_cache(path, stock)
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))
    with pytest.raises(Exception, match="block pool exhausted"):
        load_pooled_prompt_cache(path, pool, owner=1)
    assert pool.stats.blocks_in_use() == 0


def test_build_pooled_caches_rejects_sliding_window_layers():
    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=3, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
    )
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=64))
    with pytest.raises(ValueError, match="layer 1 of this model needs a RotatingKVCache"):
        build_pooled_caches(llama.Model(args), pool, owner=1)
    assert pool.stats.n_allocations == 0


def test_build_pooled_caches_without_make_cache_uses_layer_count():
    class Bare:
        layers = [object()] * 5

    pool = BlockPoolAllocator(PoolConfig(block_size=8, n_blocks=64))
    caches = build_pooled_caches(Bare(), pool, owner=1, step=24)
    assert len(caches) == 5
    assert {c.step for c in caches} == {24}
    assert all(type(c) is PoolBackedKVCache and not isinstance(c, KVCache) for c in caches)


def test_chunked_prefill_and_wide_step_match_stock(tiny_model, prompt_ids, stock_tokens):
    model, tokenizer = tiny_model
    pool = BlockPoolAllocator(PoolConfig(block_size=8, n_blocks=4096))
    cache = build_pooled_caches(model, pool, owner=1, step=24)
    tokens = [
        r.token
        for r in mlx_lm.stream_generate(
            model, tokenizer, prompt_ids, max_tokens=MAX_TOKENS, prompt_cache=cache,
            prefill_step_size=7,
        )
    ]
    assert tokens == stock_tokens
    offset = cache[0].offset
    held = -(-offset // 24) * 24 // 8  # whole 24-token steps of 8-token blocks
    assert pool.stats.blocks_in_use() == 2 * len(model.layers) * held
    used = sorted((b.n_used for b in pool.blocks_for(1) if b.stream == "k"), reverse=True)
    per_layer = [min(8, max(0, offset - i * 8)) for i in range(held)]
    assert used == sorted(per_layer * len(model.layers), reverse=True)
