"""Decode attention that reads the stored keys and values in the arena's blocks.

``paged_decode_attention`` (kernels/decode_attention.cpp) must give exactly what
``decode_attention`` gives over the same blocks gathered (same kernel, same order of
sums): whole tables or fewer columns, masks shared, per row or none, head sizes with and
without the AVX2 loop; a block id outside the arena hides its columns instead of reading
outside it; bad shapes raise a ValueError saying what. A paged batch's decode calls on
a float arena take it (no gather of the stored KV in the step's graph) with the logits
of the gathered path bit for bit, while rows join and leave; a quantized arena keeps
its gather (its blocks decode there).
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
from veloxquant_mlx import llama_model
from veloxquant_mlx.compiled_decode import compile_decode_blocks
from veloxquant_mlx.memory import paged_attention
from veloxquant_mlx.memory.kv_format import KVFormat

OPS = paged_attention.native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the native operations cannot be built here")


def _blocks_case(rows, kv_heads, d, n_blocks, bs, table_blocks, seed):
    """A random arena ``(kv_heads, n_blocks * bs, d)`` and a table of distinct ids."""
    rng = np.random.default_rng(seed)
    arena = mx.array(rng.standard_normal((kv_heads, n_blocks * bs, d)).astype(np.float32))
    ids = rng.permutation(n_blocks)[: 2 * rows * table_blocks].reshape(2 * rows, table_blocks)
    return arena, mx.array(ids.astype(np.int32))


def _gathered(arena, table, bs):
    """What the batch's gather gives for ``table``: ``(2 rows, kv_heads, blocks * bs, d)``."""
    heads, slots, d = arena.shape
    blocks = arena.reshape(heads, slots // bs, bs, d)
    rows, width = table.shape
    index = mx.broadcast_arrays(mx.arange(heads)[None, :, None], table[:, None, :])
    return blocks[tuple(index)].reshape(rows, heads, width * bs, d)


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "d", "bs"), [
    (1, 9, 3, 64, 16), (3, 4, 4, 32, 4), (2, 8, 2, 40, 8),  # 40: the plain loop
])
@pytest.mark.parametrize("masks", ["none", "shared", "per_row"])
def test_equals_decode_attention_over_the_gathered_blocks(rows, heads, kv_heads, d, bs, masks):
    table_blocks = 5
    arena, table = _blocks_case(rows, kv_heads, d, 40, bs, table_blocks, seed=rows + d)
    width = table_blocks * bs
    mx.random.seed(d)
    q = mx.random.normal((rows, heads, 1, d))
    fresh = mx.random.normal((2 * rows, kv_heads, 2, d))
    lengths = mx.array([width - 3 - r for r in range(rows)])[:, None]
    stored_mask = {"none": None,
                   "shared": (mx.arange(width) % 7 != 3).reshape(1, 1, 1, width),
                   "per_row": (mx.arange(width)[None] < lengths).reshape(rows, 1, 1, width)
                   }[masks]
    fresh_mask = None if masks == "none" else mx.ones((rows, 1, 1, 2), mx.bool_)
    got = OPS.paged_decode_attention(q, arena, table, width, fresh, stored_mask, fresh_mask,
                                     scale=0.125, block_size=bs)
    want = OPS.decode_attention(q, _gathered(arena, table, bs), fresh, stored_mask,
                                fresh_mask, scale=0.125)
    assert got.shape == q.shape and got.dtype == mx.float32
    assert np.array_equal(np.array(got), np.array(want))


def test_fewer_columns_than_the_table_covers_read_only_those():
    arena, table = _blocks_case(2, 2, 32, 30, 8, 4, seed=1)
    q, fresh = mx.random.normal((2, 4, 1, 32)), mx.random.normal((4, 2, 1, 32))
    got = OPS.paged_decode_attention(q, arena, table, 27, fresh, scale=0.2, block_size=8)
    stored = _gathered(arena, table, 8)[:, :, :27]
    want = OPS.decode_attention(q, stored, fresh, scale=0.2)
    assert np.array_equal(np.array(got), np.array(want))


def test_a_block_id_outside_the_arena_hides_its_columns():
    arena, table = _blocks_case(1, 2, 32, 20, 8, 3, seed=2)
    bad = np.array(table)
    bad[0, 1] = 20  # one past the arena's last block, in the keys' table
    q, fresh = mx.random.normal((1, 2, 1, 32)), mx.random.normal((2, 2, 1, 32))
    got = OPS.paged_decode_attention(q, arena, mx.array(bad), 24, fresh, scale=0.2,
                                     block_size=8)
    seen = (mx.arange(24) // 8 != 1).reshape(1, 1, 1, 24)
    want = OPS.decode_attention(q, _gathered(arena, table, 8), fresh, seen, scale=0.2)
    assert np.array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize(("change", "words"), [
    ({"arena": (2, 30, 32)}, "slots a multiple of block_size"),
    ({"arena": (2, 32, 16)}, "slots a multiple of block_size"),
    ({"table": (3, 4)}, "table must be"),
    ({"columns": 33}, "covering the stored columns"),
    ({"columns": 0}, "covering the stored columns"),
    ({"fresh": (4, 1, 1, 32)}, "keys' rows over values'"),
    ({"block_size": 0}, "block_size must be positive"),
])
def test_bad_shapes_raise_value_error_saying_what(change, words):
    args = {"arena": (2, 32, 32), "table": (4, 4), "columns": 32, "fresh": (4, 2, 1, 32),
            "block_size": 8, **change}
    with pytest.raises(ValueError, match=words):
        OPS.paged_decode_attention(mx.zeros((2, 4, 1, 32)), mx.zeros(args["arena"]),
                                   mx.zeros(args["table"], mx.int32), args["columns"],
                                   mx.zeros(args["fresh"]), scale=1.0,
                                   block_size=args["block_size"])


@pytest.fixture(scope="module")
def compiled(tiny_model):
    """The tiny model as the server runs it, blocks compiled (they attend through
    ``llama_model.attend_stacked``)."""
    model = llama_model.own_model(tiny_model[0])
    assert compile_decode_blocks(model) == len(model.layers)
    return model


def test_a_float_arena_is_read_in_place_and_a_quantized_one_gathered(compiled, monkeypatch):
    layers = len(compiled.layers)
    paged = _decode_step_nodes(compiled, _arena(compiled, n_blocks=4096))
    monkeypatch.setattr(llama_model, "paged_decode", lambda *args: None)
    gathered = _decode_step_nodes(compiled, _arena(compiled, n_blocks=4096))
    assert paged["DecodeAttention"] == gathered["DecodeAttention"] == layers
    assert gathered.get("Gather", 0) - paged.get("Gather", 0) == layers
    monkeypatch.undo()
    quantized = _decode_step_nodes(compiled, _arena(compiled, 4096, KVFormat("q8", 32)))
    assert quantized.get("Gather", 0) >= gathered.get("Gather", 0)


@pytest.mark.parametrize("write_back", [1, 8])
def test_logits_equal_the_gathered_path_while_rows_join_and_leave(compiled, write_back,
                                                                   monkeypatch):
    runs = []
    for paged in (True, False):
        if not paged:
            monkeypatch.setattr(llama_model, "paged_decode", lambda *args: None)
        runs.append(_joins_and_leaves(compiled, _arena(compiled, n_blocks=4096),
                                      random.Random(13), 24, join_p=0.4, leave_p=0.25,
                                      fast=True, write_back=write_back))
    assert _same_runs(*runs, np.array_equal) > 15
