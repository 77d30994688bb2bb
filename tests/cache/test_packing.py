"""Bit packing and group quantization helpers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.packing import pack_bits, packed_row_bytes, unpack_bits
from veloxquant_mlx.cache.uniform import dequantize_groups, quantize_groups


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n_codes", [1, 5, 13, 128])
def test_pack_round_trip_and_size(bits: int, n_codes: int) -> None:
    rng = np.random.default_rng(bits * 100 + n_codes)
    codes = rng.integers(0, 2**bits, size=(7, n_codes)).astype(np.uint8)
    packed = pack_bits(mx.array(codes), bits)
    assert packed.dtype == mx.uint8
    assert packed.shape == (7, -(-n_codes * bits // 8))
    assert packed.nbytes == 7 * packed_row_bytes(n_codes, bits)
    np.testing.assert_array_equal(np.array(unpack_bits(packed, bits, n_codes)), codes)


def test_pack_known_layout_lsb_first() -> None:
    # codes 1, 2, 3 at 2 bits -> stream 10 01 11 (LSB first) = 0b00111001
    packed = pack_bits(mx.array([[1, 2, 3]], dtype=mx.uint8), 2)
    assert np.array(packed).tolist() == [[0b00111001]]


def test_rows_pack_independently() -> None:
    codes = mx.array(np.arange(30, dtype=np.uint8).reshape(3, 10) % 8)
    whole = pack_bits(codes, 3)
    parts = mx.concatenate([pack_bits(codes[:1], 3), pack_bits(codes[1:], 3)])
    assert mx.array_equal(whole, parts).item()


@pytest.mark.parametrize("bad", [0, 9])
def test_pack_rejects_bits_outside_1_to_8(bad: int) -> None:
    with pytest.raises(ValueError, match="1..8"):
        pack_bits(mx.zeros((1, 4), dtype=mx.uint8), bad)


@pytest.mark.parametrize("bits", [2, 4])
def test_group_quantization_error_is_at_most_half_a_step(bits: int) -> None:
    x = mx.array(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32) * 3)
    q = quantize_groups(x, bits, 16)
    assert q.scale.shape == (16, 4) and q.scale.dtype == mx.float16
    back = np.array(dequantize_groups(q, bits, 16, 64)).reshape(16, 4, 16)
    step = np.array(q.scale.astype(mx.float32))[..., None]
    err = np.abs(back - np.array(x).reshape(16, 4, 16))
    # Half a step, plus float16 rounding of the stored minimum.
    assert np.all(err <= 0.5 * step + 4e-3)


def test_constant_group_decodes_exactly() -> None:
    x = mx.full((2, 8), 1.5)
    q = quantize_groups(x, 2, 8)
    np.testing.assert_allclose(np.array(dequantize_groups(q, 2, 8, 8)), 1.5)
