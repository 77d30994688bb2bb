"""turboquant_mse and polar as formats of the pool: the same family as their per-request caches.

Both code each vector alone, so the pool stores them like q8/q4 (codes and
float16 params per head and token). These tests hold the pool's codecs to the
per-request caches of ``veloxquant_mlx.cache`` (same seed: same bytes, same
reconstruction), check the bytes a token costs, and run a batch of the tiny
model on each (helpers of ``test_paged_batch.py``).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.memory.test_kv_formats import _arena
from tests.memory.test_paged_batch import BS, _held_exactly, _paged, _prompt, _stock
from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory
from veloxquant_mlx.exceptions import KVFormatError
from veloxquant_mlx.memory.kv_format import KVFormat

METHODS = ("turboquant_mse", "polar")


@pytest.fixture
def model(served_model):
    return served_model


def test_bytes_and_tags_of_the_method_formats():
    # head_dim 64: 4-bit codes of 64 coordinates + a float16 norm; polar's 4/2/2/2 angles
    # of four 16-blocks (16 + 4 + 2 + 1 bytes) + four float16 radii.
    assert KVFormat("turboquant_mse").vector_bytes(64, mx.float32) == 32 + 2
    assert KVFormat("polar").vector_bytes(64, mx.float16) == 23 + 8
    assert KVFormat("turboquant_mse").tag(mx.float32) == "tq4"
    assert KVFormat("polar").tag(mx.bfloat16) == "polar4"
    assert KVFormat("polar").quantized and KVFormat("turboquant_mse").bits == 4


def test_a_head_dim_a_method_cannot_code_is_refused():
    with pytest.raises(KVFormatError, match="polar.*multiple of 16"):
        KVFormat("polar").check(72)
    KVFormat("polar").check(80)
    KVFormat("turboquant_mse").check(72)


@pytest.mark.parametrize("method", METHODS)
def test_the_pool_codes_a_vector_as_the_per_request_cache_does(method):
    fmt = KVFormat(method)
    x = mx.random.normal((2, 5, 64), key=mx.random.key(3)) * 2 + 0.3
    codes, params = fmt.encode(x)
    assert codes.dtype == mx.uint8 and params.dtype == mx.float16
    assert codes.shape == (2, 5, fmt.code_width(64)) and params.shape == (2, 5,
                                                                          fmt.param_width(64))
    cache = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, seed=0))
    rows = x.reshape(10, 64)
    cache.append_key(rows)
    cache.append_value(rows)
    got = fmt.decode(codes, params, mx.float32, 64)
    # Same constants, same arithmetic: the reconstruction the cache attends with.
    assert mx.allclose(got.reshape(10, 64), cache.decode_keys(), atol=1e-5).item()
    assert mx.allclose(got.reshape(10, 64), cache.decode_values(), atol=1e-5).item()
    error = mx.linalg.norm(got - x, axis=-1) / mx.linalg.norm(x, axis=-1)
    assert error.max().item() < 0.25 and error.min().item() > 0  # lossy, and close


def test_decoding_without_the_head_dim_is_refused():
    codes, params = KVFormat("polar").encode(mx.ones((3, 64)))
    with pytest.raises(KVFormatError, match="needs the head_dim"):
        KVFormat("polar").decode(codes, params, mx.float32)


@pytest.mark.parametrize("method", METHODS)
def test_the_arena_holds_the_codec_widths(model, method):
    arena = _arena(model, KVFormat(method), n_blocks=64)
    codes, params = arena.data
    width = {"turboquant_mse": (16, 1), "polar": (8 + 2 + 1 + 1, 2)}[method]  # head_dim 32
    assert (codes.shape[-1], params.shape[-1]) == width
    assert codes.nbytes + params.nbytes == arena.nbytes == 65 * arena.layout.bytes_per_block(BS)


# Measured max logit gap to the float cache here: q4 (group 32) 0.16, turboquant_mse 0.22,
# polar 0.51 (3.875 bits a coordinate at head_dim 32, against q4's 5).
@pytest.mark.parametrize(("method", "tolerance"), [("turboquant_mse", 0.35), ("polar", 0.75)])
def test_a_batch_on_a_method_format_tracks_stock_and_is_the_same_alone(model, method, tolerance):
    prompts = [_prompt(i, n) for i, n in enumerate((7, 33, 16, 50))]
    stock = [_stock(model, p, 8) for p in prompts]
    arena = _arena(model, KVFormat(method))
    batch, together = _paged(model, arena, prompts, 8)
    _held_exactly(arena.pool, batch, 4)
    tag = arena.format_tag
    for owner in batch.owners:
        assert {b.format for b in arena.pool.blocks_for(owner)} == {tag}
    for want, got in zip(stock, together, strict=True):
        for a, b in zip(want, got, strict=True):
            assert mx.abs(a - b).max().item() < tolerance
    # Each vector is coded alone: a row's logits do not depend on its neighbours.
    _, alone = _paged(model, _arena(model, KVFormat(method)), [prompts[1]], 8)
    assert all(mx.array_equal(a, b) for a, b in zip(alone[0], together[1], strict=True))
    batch.release()
    assert arena.pool.stats.blocks_in_use() == 0

