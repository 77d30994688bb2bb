"""Quantized KV in the arena: q8 and q4 blocks, their bytes, their accuracy, their bounds.

Tiny model (4 layers, 2 KV heads of 32, float32), tiny pools, as in
``test_paged_batch.py`` (whose helpers these tests reuse). Checks the format
arithmetic exactly, that decoding inverts ``mx.quantize``'s affine scheme,
that a quantized batch stays close to the stock float cache and gives the
same logits alone or in a batch, that every block of a request carries the
arena's one format, and that MLX memory above idle stays within the blocks
in use plus the workspace bound for every format.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from tests.memory.test_paged_batch import (
    BS,
    _held_exactly,
    _joins_and_leaves,
    _paged,
    _prompt,
    _stock,
)
from veloxquant_mlx.exceptions import KVFormatError, VeloxQuantError
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout
from veloxquant_mlx.memory.kv_format import KVFormat


@pytest.fixture
def model(served_model):
    """The paged batch serves the project's model (its attention reads the parts)."""
    return served_model


def _arena(model, fmt: KVFormat, n_blocks=2048, **config) -> KVArena:
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks, **config))
    return KVArena(pool, probe_kv_layout(model, fmt))


def test_bad_names_and_groups_are_refused_with_the_choices():
    with pytest.raises(KVFormatError, match="native, q8, q4"):
        KVFormat("q5")
    with pytest.raises(KVFormatError, match="32, 64, 128"):
        KVFormat("q8", 48)
    with pytest.raises(KVFormatError, match="group_size of 32"):
        KVFormat("q4", 64).check(96)
    assert issubclass(KVFormatError, VeloxQuantError) and issubclass(KVFormatError, ValueError)


def test_bytes_per_token_of_each_format():
    # head_dim 64 (SmolLM2): codes, then per group q8's zero point and float16 scale,
    # q4's float16 scale and bias.
    assert KVFormat().vector_bytes(64, mx.float32) == 256
    assert KVFormat().vector_bytes(64, mx.float16) == 128
    assert KVFormat("q8", 64).vector_bytes(64, mx.float32) == 64 + 1 + 2
    assert KVFormat("q4", 64).vector_bytes(64, mx.float32) == 32 + 4
    assert KVFormat("q4", 32).vector_bytes(64, mx.float32) == 32 + 8
    assert KVFormat("q8", 128).vector_bytes(128, mx.float16) == 128 + 1 + 2
    assert 128 / 67 >= 1.9 and 128 / 36 >= 3.5  # the tokens-per-byte targets
    assert (KVFormat("q8").tag(mx.float32), KVFormat("q4", 32).tag(mx.float32),
            KVFormat().tag(mx.float32), KVFormat().tag(mx.bfloat16)) == (
                "q8g64", "q4g32", "fp32", "bf16")


def test_q8_decodes_its_zero_points_and_scales():
    fmt = KVFormat("q8", 32)
    x = mx.random.normal((3, 20, 64), key=mx.random.key(8)) * 3 + 0.5
    codes, scale = fmt.encode(x)
    assert codes.dtype == mx.uint8 and codes.shape == (3, 20, 64 + 2)
    assert scale.dtype == mx.float16 and scale.shape == (3, 20, 2)
    got = fmt.decode(codes, scale, mx.float32)
    step = mx.repeat(scale.astype(mx.float32), 32, axis=-1)
    zero = mx.repeat(codes[..., 64:].astype(mx.float32), 32, axis=-1)
    assert mx.array_equal(got, (codes[..., :64].astype(mx.float32) - zero) * step).item()
    # Half a step off at most: the codes were chosen for the float16 scale decode reads.
    assert (mx.abs(got - x) <= 0.5 * step * (1 + 1e-3)).all().item()
    assert (mx.abs(got - x) >= 1e-7).any().item()  # it really is lossy


def test_q4_decodes_as_mx_dequantize_reads_the_same_codes():
    fmt = KVFormat("q4", 32)
    x = mx.random.normal((3, 20, 64), key=mx.random.key(4)) * 3
    codes, params = fmt.encode(x)
    assert codes.dtype == mx.uint8 and codes.shape == (3, 20, 32)
    assert params.dtype == mx.float16 and params.shape == (3, 20, 4)
    got = fmt.decode(codes, params, mx.float32)
    scale, bias = params[..., :2].astype(mx.float32), params[..., 2:].astype(mx.float32)
    # mx.quantize's affine scheme and nibble order: mx.dequantize reads our bytes as words.
    words = codes.reshape(3, 20, -1, 4).view(mx.uint32).reshape(3, 20, -1)
    assert mx.allclose(got, mx.dequantize(words, scale, bias, 32, 4), atol=1e-5).item()
    # Half a step off at most, plus the float16 rounding of the bias (the group minimum).
    step = mx.repeat(scale, 32, axis=-1)
    assert (mx.abs(got - x) <= 0.5 * step + 1e-3 * mx.abs(mx.repeat(bias, 32, -1)) + 1e-5
            ).all().item()


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_the_arena_holds_exactly_the_bytes_the_pool_counts(model, name):
    arena = _arena(model, KVFormat(name, 32), n_blocks=64)
    codes, params = arena.data
    slots = (64 + 1) * BS
    # head_dim 32, one group: q8 32 codes + a zero point, one scale; q4 16 bytes, scale + bias
    code_bytes, n_params = {"q8": (33, 1), "q4": (16, 2)}[name]
    assert codes.shape == (2, slots, code_bytes) and codes.dtype == mx.uint8
    assert params.shape == (2, slots, n_params) and params.dtype == mx.float16
    per_block = arena.layout.bytes_per_block(BS)
    assert per_block == BS * 2 * (code_bytes + 2 * n_params)
    assert codes.nbytes + params.nbytes == arena.nbytes == 65 * per_block


@pytest.mark.parametrize(("name", "tolerance"), [("q8", 0.05), ("q4", 0.5)])
def test_quantized_batch_tracks_stock_and_is_the_same_alone(model, name, tolerance):
    prompts = [_prompt(i, n) for i, n in enumerate((7, 33, 16, 50))]
    stock = [_stock(model, p, 10) for p in prompts]
    arena = _arena(model, KVFormat(name, 32))
    batch, together = _paged(model, arena, prompts, 10)
    _held_exactly(arena.pool, batch, 4)
    for want, got in zip(stock, together, strict=True):
        for a, b in zip(want, got, strict=True):
            assert mx.abs(a - b).max().item() < tolerance
            if name == "q8":  # the random model's logits are flat: q4 may swap near-ties
                assert mx.argmax(a, -1).item() == mx.argmax(b, -1).item()
    # Quantization is per token and head: a row's logits do not depend on its neighbours.
    for i, prompt in enumerate(prompts[:2]):
        _, alone = _paged(model, _arena(model, KVFormat(name, 32)), [prompt], 10)
        assert all(mx.array_equal(a, b) for a, b in zip(alone[0], together[i], strict=True))
    batch.release()
    assert arena.pool.stats.blocks_in_use() == 0


def test_every_block_of_a_request_has_the_arena_format(model):
    q8 = _arena(model, KVFormat("q8", 32))
    native = _arena(model, KVFormat())
    batch, _ = _paged(model, q8, [_prompt(1, 40), _prompt(2, 5)], 3)
    for owner in batch.owners:
        assert {b.format for b in q8.pool.blocks_for(owner)} == {"q8g32"}
    other, _ = _paged(model, native, [_prompt(3, 9)], 1, owner0=50)
    assert {b.format for b in native.pool.blocks_for(50)} == {"fp32"}
    with pytest.raises(ValueError, match="same arena"):
        batch.extend(other)  # rows of another format never join this batch
    batch.release()
    other.release()


@pytest.mark.parametrize("name", ["native", "q8", "q4", "turboquant_mse", "polar"])
def test_memory_above_idle_stays_within_blocks_plus_workspace(model, name):
    _joins_and_leaves(model, _arena(model, KVFormat(name, 32), n_blocks=4096),
                      random.Random(11), 25, join_p=0.5)
