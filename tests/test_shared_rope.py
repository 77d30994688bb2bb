"""RoPE tables once per step (veloxquant_mlx/shared_rope.py).

The rotation from shared tables must be bit for bit ``mx.fast.rope`` on the
CPU for every setting mlx-lm's plain and Llama-3 rope modules use; the tables
are built once per offset array; other rope modules are left to themselves.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE

from veloxquant_mlx.shared_rope import shared_rope

SETTINGS = list(itertools.product(
    [10000.0, 100000.0, 500000.0, 1234.5],  # base
    [False, True],  # traditional
    [(64, 64), (32, 64)],  # rotated dims, head dim
    [1.0, 0.25],  # scale
))


@pytest.mark.parametrize(("base", "traditional", "dims", "scale"), SETTINGS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rotation_is_fast_rope_bit_for_bit(base, traditional, dims, scale, dtype):
    rotated, head = dims
    module = nn.RoPE(rotated, traditional=traditional, base=base, scale=scale)
    rope = shared_rope(module)
    assert rope is not None
    rng = np.random.default_rng(7)
    compiled = mx.compile(rope.rotate)
    for rows, n in ((1, 1), (5, 1), (3, 6)):
        x = mx.array(rng.standard_normal((rows, 4, n, head)).astype(np.float32)).astype(dtype)
        offset = mx.array(rng.integers(0, 5000, rows).astype(np.int32))
        want = module(x, offset=offset)
        cos, sin = rope.tables(offset, n)
        assert mx.array_equal(rope.rotate(x, cos, sin), want)
        assert mx.array_equal(compiled(x, cos, sin), want)  # as the compiled halves run it


def test_llama3_frequencies_rotate_bit_for_bit():
    module = Llama3RoPE(64, 2048, False, 500000.0,
                        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})
    rope = shared_rope(module)
    x = mx.random.normal((3, 4, 1, 64), key=mx.random.key(1))
    offset = mx.array([5, 900, 7000], dtype=mx.int32)
    assert mx.array_equal(rope.rotate(x, *rope.tables(offset, 1)), module(x, offset=offset))


def test_tables_are_built_once_per_offset_array():
    rope = shared_rope(nn.RoPE(32))
    offset = mx.array([3, 4], dtype=mx.int32)
    first = rope.tables(offset, 1)
    assert rope.tables(offset, 1) is first  # every layer of a step: the same arrays
    again = rope.tables(mx.array([3, 4], dtype=mx.int32), 1)  # the next step's offsets
    assert again is not first and mx.array_equal(again[0], first[0])
    assert rope.tables(offset, 2)[0].shape != first[0].shape  # another column count


def test_rope_modules_that_rescale_their_input_are_left_alone():
    module = SuScaledRoPE(64, max_position_embeddings=4096,
                          original_max_position_embeddings=2048,
                          short_factor=[1.0] * 32, long_factor=[2.0] * 32)
    assert shared_rope(module) is None
    assert shared_rope(object()) is None
