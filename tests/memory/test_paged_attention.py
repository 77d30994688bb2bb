"""The paged batch's CPU attention: its exp, its attention, and which calls it serves."""

from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.llama_model import own_model
from veloxquant_mlx.memory import paged_attention
from veloxquant_mlx.memory.paged_attention import (
    attention,
    attention_parts,
    fast_exp,
    scaled_dot_product_attention,
    softmax,
)


@pytest.fixture
def model(served_model):
    """The paged batch serves the project's model (its attention reads the parts)."""
    return served_model


def test_fast_exp_matches_exp_over_a_softmax_range():
    x = mx.concatenate([-mx.random.uniform(shape=(200_000,)) * 87, mx.array([0.0, -0.5, -1e-8])])
    got, want = fast_exp(x), mx.exp(x)  # exp(-87) = 1.6e-38: still a normal float32
    assert (mx.abs(got - want) / want).max().item() < 2e-7
    tiny = fast_exp(-87 - mx.random.uniform(shape=(1000,)) * 40)  # below float32's normals
    assert tiny.max().item() < 2e-38
    assert fast_exp(mx.array([0.0])).item() == 1.0


def test_fast_exp_of_minus_inf_and_far_below_is_zero():
    got = fast_exp(mx.array([-mx.inf, -200.0, -1000.0]))
    assert got.tolist() == [0.0, 0.0, 0.0]


def test_softmax_rows_sum_to_one_along_either_axis():
    s = mx.random.normal((3, 5, 7)) * 10
    for axis in (-1, 1):
        got = softmax(s, axis=axis)
        assert mx.allclose(got, mx.softmax(s, axis=axis), atol=1e-6)
        assert mx.allclose(got.sum(axis=axis), mx.ones(1), atol=1e-6)


@pytest.mark.parametrize("rows,new,keys", [(1, 65, 300), (4, 1, 130), (3, 5, 40), (2, 1, 1)])
def test_attention_is_mlx_sdpa_within_float_rounding(rows, new, keys):
    mx.random.seed(rows * 100 + new)
    q = mx.random.normal((rows, 6, new, 32))
    k = mx.random.normal((rows, 2, keys, 32))
    v = mx.random.normal((rows, 2, keys, 32))
    mask = (mx.random.uniform(shape=(rows, 1, new, keys)) < 0.8) | (mx.arange(keys) == 0)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert mx.allclose(attention(q, k, v, 0.2, mask), want, atol=2e-6)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2)
    assert mx.allclose(attention(q, k, v, 0.2, None), want, atol=2e-6)


def test_long_prompts_are_taken_in_blocks_with_the_same_result(monkeypatch):
    q = mx.random.normal((1, 4, 50, 16))
    k, v = mx.random.normal((1, 2, 60, 16)), mx.random.normal((1, 2, 60, 16))
    mask = mx.arange(60)[None, None, None, :] <= mx.arange(50)[None, None, :, None] + 10
    whole = attention(q, k, v, 0.25, mask)
    monkeypatch.setattr(paged_attention, "SCORES_PER_BLOCK", 4 * 60 * 7)  # 7 columns a block
    assert mx.allclose(attention(q, k, v, 0.25, mask), whole, atol=1e-6)


@pytest.mark.parametrize("rows_per_block", [7, 1000])
def test_parts_under_one_softmax_equal_the_concatenated_keys(monkeypatch, rows_per_block):
    """Stored keys plus a causal new part, in blocks or not: attention over the whole."""
    mx.random.seed(3)
    rows, new, stored = 2, 40, 25
    q = mx.random.normal((rows, 4, new, 16))
    k1, v1 = mx.random.normal((rows, 2, stored, 16)), mx.random.normal((rows, 2, stored, 16))
    k2, v2 = mx.random.normal((rows, 2, new, 16)), mx.random.normal((rows, 2, new, 16))
    past = mx.array([25, 9])  # row 1 stored fewer tokens than the gathered width
    m1 = mx.arange(stored)[None, None, None, :] < past[:, None, None, None]
    c = mx.arange(new)
    m2 = mx.broadcast_to((c[None, :] <= c[:, None])[None, None], (rows, 1, new, new))
    whole = attention(q, mx.concatenate([k1, k2], 2), mx.concatenate([v1, v2], 2), 0.25,
                      mx.concatenate([mx.broadcast_to(m1, (rows, 1, new, stored)), m2], -1))
    monkeypatch.setattr(paged_attention, "SCORES_PER_BLOCK", 4 * (stored + new) * rows_per_block)
    for causal in (False, True):
        got = attention_parts(q, [k1, k2], [v1, v2], 0.25, [m1, m2], causal_last=causal)
        assert mx.allclose(got, whole, atol=1e-6)


def test_causal_last_needs_a_square_last_part():
    q = mx.random.normal((1, 2, 4, 8))
    k = mx.random.normal((1, 2, 5, 8))
    with pytest.raises(ValueError, match="causal_last"):
        attention_parts(q, [k], [k], 1.0, [None], causal_last=True)


def test_calls_on_other_caches_go_to_mlx_lms_attention(monkeypatch):
    calls = []

    def stock(queries, keys, values, cache, scale, mask):
        calls.append(cache)
        return queries

    monkeypatch.setattr(paged_attention, "stock_attention", stock)
    q = mx.zeros((1, 2, 1, 4))
    cache = object()  # not a paged cache
    assert scaled_dot_product_attention(q, q, q, cache, 1.0, None) is q
    assert calls == [cache]


def test_a_call_left_to_mlx_lm_holds_no_parts_after_it(tiny_model_path):
    """A paged call the router does not serve drops its parts too.

    Parts kept past their call can pin the arena version they were read from,
    and on a GPU (where every call is left to mlx-lm) each write makes a whole
    new one: on an H200, an unclosed batch keeps an old copy until a gc runs. A
    bfloat16 call on the CPU is left to mlx-lm the same way.
    """
    import mlx_lm

    from tests.memory.test_paged_batch import _arena, _prompt
    from veloxquant_mlx.memory.request_blocks import make_batch_caches

    model = own_model(mlx_lm.load(str(tiny_model_path))[0])
    model.set_dtype(mx.bfloat16)
    arena = _arena(model)
    batch = make_batch_caches(model, arena, [1, 2], [3, 0])
    assert batch.fast_attention  # the parts are kept for the owned attention
    prompts = [[0] * 3 + _prompt(1, 9), _prompt(2, 12)]
    logits = model(mx.array(prompts), cache=batch.caches)[:, -1]
    assert all(cache.parts is None for cache in batch.caches)
    model(mx.argmax(logits, -1)[:, None], cache=batch.caches)
    assert all(cache.parts is None for cache in batch.caches)
    batch.close()
    assert arena.pool.stats.blocks_in_use() == 0


def test_a_batch_of_a_model_that_does_not_read_parts_keeps_none(model, tiny_model):
    """mlx-lm's own model never takes the parts: nothing would drop them."""
    from tests.memory.test_paged_batch import _arena
    from veloxquant_mlx.memory.request_blocks import make_batch_caches

    arena = _arena(model)
    batch = make_batch_caches(tiny_model[0], arena, [1])
    assert not batch.fast_attention
    assert make_batch_caches(model, arena, [2]).fast_attention
