"""A decode batch holding its newest columns out of the arena (write-back).

The held columns must change nothing a model computes: the same logits as
writing every call (bit for bit on mlx-lm's attention) while rows join and
leave, the same blocks held per owner, memory within the workspace bound
that counts them; and the arena is written once per ``write_back`` calls.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from tests.memory.test_paged_batch import (
    _arena,
    _held_exactly,
    _joins_and_leaves,
    _paged,
    _prompt,
    _stock,
)
from veloxquant_mlx.memory import paged_attention
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout
from veloxquant_mlx.memory.kv_format import KVFormat
from veloxquant_mlx.memory.write_back import HeldColumns, held_bytes


@pytest.fixture
def model(served_model):
    """The paged batch serves the project's model (its attention reads the parts)."""
    return served_model


def _decode(model, batch, logits, steps):
    out = []
    for _ in range(steps):
        out.append(logits)
        logits = model(mx.argmax(logits, -1)[:, None], cache=batch.caches)[:, -1]
    return out


def _count_writes(arena: KVArena, monkeypatch) -> list[int]:
    writes = []
    real = arena.store

    def counted(heads, slots, values):
        writes.append(slots.size)
        real(heads, slots, values)

    monkeypatch.setattr(arena, "store", counted)
    return writes


@pytest.mark.parametrize("fast", [False, True])
def test_held_columns_give_the_stock_logits(model, monkeypatch, fast):
    """Prompts prefill as usual; 30 decode calls hold 8 columns at a time."""
    monkeypatch.setattr(paged_attention, "FAST_MIN_SCORES", 0)  # every call on the fast path
    arena = _arena(model)
    prompts = [_prompt(i, n) for i, n in enumerate((7, 33, 16, 50))]
    batch, first = _paged(model, arena, prompts, 0, fast=fast)
    logits = model(mx.array([[3], [4], [5], [6]]), cache=batch.caches)[:, -1]
    batch.write_back = 8
    writes = _count_writes(arena, monkeypatch)
    got = _decode(model, batch, logits, 30)
    # 30 calls hold 8 at a time: the 9th, 17th and 25th calls write the 8 before them.
    assert len(writes) == 3 and writes[0] == 4 * 2 * 4 * 8  # layers x k,v x rows x columns
    assert batch.held.count == 30 - 24
    _held_exactly(arena.pool, batch, 4)
    batch.release()
    for i, p in enumerate(prompts):
        stock = _stock(model, p + [3 + i], 30)
        for step, (want, have) in enumerate(zip(stock, got, strict=True)):
            row = have[i: i + 1]
            if fast:
                assert mx.abs(want - row).max().item() < 1e-5, (i, step)
            else:
                assert mx.array_equal(want, row), (i, step)  # bit-identical
    assert arena.pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("seed", [3, 11])
@pytest.mark.slow
def test_joins_and_leaves_while_holding_match_writing_every_call(model, seed):
    def run(write_back):
        return _joins_and_leaves(model, _arena(model, n_blocks=4096), random.Random(seed), 36,
                                 join_p=0.35, leave_p=0.25, write_back=write_back)

    every, held = run(1), run(6)
    assert sum(t is not None for t in held) > 20
    for a, b in zip(every, held, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a[0] == b[0] and np.array_equal(a[1], b[1])


def test_a_quantized_arena_stores_what_was_held(model):
    """q8 blocks: flushed columns read back within the format's error of the held ones."""
    layout = probe_kv_layout(model, KVFormat("q8", 32))
    arena = KVArena(_arena(model).pool, layout)
    batch, _ = _paged(model, arena, [_prompt(1, 20), _prompt(2, 35)], 0)
    batch.write_back = 16
    logits = model(mx.array([[3], [4]]), cache=batch.caches)[:, -1]
    _decode(model, batch, logits, 5)
    count = batch.held.count
    assert count == 6  # the first call and 5 more
    held = batch.held._layers[2]  # layer 2: (keys' rows, values' rows, H, 6, D)
    before = [batch.rows[i].tokens for i in range(2)]
    batch.flush()
    assert batch.held.count == 0
    batch.begin(1)  # a fresh view: the 6 columns are now stored tokens
    stored = arena.gather(batch._gather_index[2], 4, batch._width)
    for i, tokens in enumerate(before):
        for part in (0, 1):  # keys, values
            want = held[part * 2 + i, :, :, :]
            got = stored[part * 2 + i, :, tokens - count: tokens, :]
            assert mx.abs(want - got).max().item() < 0.02 * mx.abs(want).max().item() + 1e-6
    batch.release()


def test_held_columns_bookkeeping():
    held = HeldColumns(n_layers=2, limit=4, rows=2)
    held.open()
    for layer in range(2):
        held.append(layer, mx.full((4, 1, 1, 3), float(layer)))
    held.add_rows(1)  # a third row joins holding nothing
    held.open()
    for layer in range(2):
        out = held.append(layer, mx.full((6, 1, 1, 3), 10.0 + layer))
        assert out.shape == (6, 1, 2, 3)
    assert held.per_row().tolist() == [2, 2, 1]
    assert np.array(held.mask()).reshape(3, 2).tolist() == [[True, True], [True, True],
                                                            [False, True]]
    held.keep([2, 0])
    assert held.per_row().tolist() == [1, 2] and held._layers[0].shape == (4, 1, 2, 3)
    assert held.stacked().shape == (1, 2 * 4 * 2, 3)
    held.keep([])
    assert held.count == 0 and held.per_row().size == 0
    with pytest.raises(ValueError, match="at least 1"):
        HeldColumns(2, 0, 1)
    assert held_bytes(4, 2, 32, mx.float32, 6, 1) == 0
    assert held_bytes(4, 2, 32, mx.float32, 6, 8) == 4 * 4 * 2 * 6 * 2 * 8 * 32 * 4
