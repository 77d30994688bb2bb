"""One decode call's attention as one native operation (kernels/decode_attention.cpp).

``decode_attention`` must give what the MLX ops of ``paged_attention.attention_parts``
give for one query column a row over a stored and a new part (grouped heads, masks
shared or per row, either part unmasked, head sizes with and without the AVX2 loop),
refuse bad shapes with a ValueError saying what is wrong, and take a paged batch's small
decode calls (one node a layer) with the logits of the MLX path.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from tests.memory.test_paged_batch import (
    _arena,
    _decode_step_nodes,
    _joins_and_leaves,
    _same_runs,
)
from veloxquant_mlx.memory import paged_attention
from veloxquant_mlx.memory.paged_layer_cache import split_parts

OP = paged_attention.native_decode_attention()
pytestmark = pytest.mark.skipif(OP is None, reason="the native operations cannot be built here")


@pytest.fixture
def model(served_model):
    """The project's model: its attention is paged_attention's."""
    return served_model


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _case(rows, heads, kv_heads, d, stored, fresh, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((rows, heads, 1, d)),
            mx.random.normal((2 * rows, kv_heads, stored, d)),
            mx.random.normal((2 * rows, kv_heads, fresh, d)))


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "d"), [
    (1, 9, 3, 64), (3, 4, 4, 32), (2, 8, 2, 40),  # 40: not a multiple of 8, the plain loop
])
@pytest.mark.parametrize("masks", ["none", "shared", "per_row", "fresh_only"])
def test_matches_the_mlx_parts_path(rows, heads, kv_heads, d, masks):
    q, stored, fresh = _case(rows, heads, kv_heads, d, 37, 3, seed=rows + d)
    seen = mx.array([[j % 5 != 2 for j in range(37)] for _ in range(rows)])
    lengths = mx.array([30 + r for r in range(rows)])[:, None]
    stored_mask = {"none": None, "fresh_only": None, "shared": seen[:1].reshape(1, 1, 1, 37),
                   "per_row": (mx.arange(37)[None] < lengths).reshape(rows, 1, 1, 37)}[masks]
    fresh_mask = (mx.arange(3)[None] >= mx.array([r % 3 for r in range(rows)])[:, None]
                  ).reshape(rows, 1, 1, 3) if masks in ("per_row", "fresh_only") else None
    got = OP(q, stored, fresh, stored_mask, fresh_mask, scale=0.125)
    keys, values, part_masks = split_parts(stored, fresh, stored_mask, fresh_mask)
    want = paged_attention.attention_parts(q, keys, values, 0.125, part_masks)
    assert got.shape == q.shape and got.dtype == mx.float32
    assert rel_err(got, want) < 1e-5


def test_a_row_that_sees_nothing_gets_zeros():
    q, stored, fresh = _case(2, 4, 2, 32, 8, 1)
    stored_mask = mx.array([[True] * 8, [False] * 8]).reshape(2, 1, 1, 8)
    fresh_mask = mx.array([True, False]).reshape(2, 1, 1, 1)
    out = np.array(OP(q, stored, fresh, stored_mask, fresh_mask, scale=1.0))
    assert np.all(out[1] == 0) and np.all(np.isfinite(out[0])) and np.any(out[0] != 0)


@pytest.mark.parametrize(("change", "words"), [
    ({"q": (2, 4, 2, 32)}, "one column a row"),
    ({"stored": (4, 2, 8, 16)}, "keys' rows over values'"),
    ({"fresh": (4, 1, 1, 32)}, "keys' rows over values'"),
    ({"q": (2, 3, 1, 32)}, "multiple of kv_heads"),
    ({"stored_mask": (2, 1, 1, 7)}, "stored_mask must hold one value a column"),
    ({"fresh_mask": (3, 1, 1, 1)}, "fresh_mask must hold one value a column"),
])
def test_bad_shapes_raise_value_error_saying_what(change, words):
    shapes = {"q": (2, 4, 1, 32), "stored": (4, 2, 8, 32), "fresh": (4, 2, 1, 32),
              "stored_mask": (2, 1, 1, 8), "fresh_mask": (2, 1, 1, 1), **change}
    arrays = {k: mx.zeros(v, mx.bool_ if "mask" in k else mx.float32) for k, v in shapes.items()}
    with pytest.raises(ValueError, match=words):
        OP(arrays["q"], arrays["stored"], arrays["fresh"], arrays["stored_mask"],
           arrays["fresh_mask"], scale=1.0)


def test_small_decode_calls_take_one_node_a_layer(model):
    nodes = _decode_step_nodes(model, _arena(model))
    assert nodes["DecodeAttention"] == len(model.layers)
    assert "Softmax" not in nodes


@pytest.mark.parametrize("write_back", [1, 8])
def test_decode_logits_match_the_mlx_path_while_rows_join_and_leave(model, write_back,
                                                                    monkeypatch):
    runs = []
    for limit in (-1, paged_attention.NATIVE_MAX_SCORES):  # MLX's ops, then the native op
        monkeypatch.setattr(paged_attention, "NATIVE_MAX_SCORES", limit)
        runs.append(_joins_and_leaves(model, _arena(model, n_blocks=4096), random.Random(11),
                                      24, join_p=0.4, leave_p=0.25, fast=True,
                                      write_back=write_back))
    assert _same_runs(*runs, lambda got, want: rel_err(got, want) < 1e-4) > 15
