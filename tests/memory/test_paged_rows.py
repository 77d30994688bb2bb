"""The paged batch's row bookkeeping (veloxquant_mlx/memory/paged_rows.py), on a real pool."""

from __future__ import annotations

import pytest

from veloxquant_mlx.exceptions import BlockPoolExhaustedError
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.paged_rows import PagedRow, advance, block_table, free, grow

BS, LAYERS = 4, 3
STREAMS = 2 * LAYERS


def _pool(n_blocks: int = 200) -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks))


def _check(pool: BlockPoolAllocator, row: PagedRow) -> None:
    """The row's invariant: ceil(tokens / BS) blocks per stream, exact n_used, ids mirrored."""
    per_stream = -(-row.tokens // BS)
    assert [len(stream) for stream in row.blocks] == [per_stream] * STREAMS
    for s, stream in enumerate(row.blocks):
        assert list(row.ids[s, :per_stream]) == [b.block_id for b in stream]
        assert all(b.owner == row.owner for b in stream)
        # keys on even streams, values on odd ones
        assert {b.stream for b in stream} <= {"k" if s % 2 == 0 else "v"}
        used = [min(row.tokens - i * BS, BS) for i in range(per_stream)]
        assert [b.n_used for b in stream] == used
    assert len(pool.blocks_for(row.owner)) == STREAMS * per_stream


def _feed(pool: BlockPoolAllocator, rows: list[PagedRow], n: int) -> None:
    lead = [min(r.pad, n) for r in rows]
    grow(pool, rows, [n - p for p in lead], BS, "fp32")
    advance(pool, rows, n, lead, BS)


def test_rows_grow_block_by_block_and_by_whole_prompts():
    pool = _pool()
    rows = [PagedRow.empty(1, 0, STREAMS), PagedRow.empty(2, 3, STREAMS)]
    _feed(pool, rows, 9)  # a prompt call: 9 and 6 real tokens (row 2 pads 3)
    assert [r.tokens for r in rows] == [9, 6] and rows[1].pad == 0
    for _ in range(11):  # decode calls, crossing several block boundaries
        _feed(pool, rows, 1)
        for row in rows:
            _check(pool, row)
    assert [r.tokens for r in rows] == [20, 17]
    # the ids array grew past its first 4 columns and kept the earlier ids
    assert rows[0].ids.shape[1] >= 5


def test_block_table_pads_shorter_rows_with_trash():
    pool = _pool()
    rows = [PagedRow.empty(1, 0, STREAMS), PagedRow.empty(2, 0, STREAMS)]
    grow(pool, rows, [9, 2], BS, "fp32")
    advance(pool, rows, 9, [0, 7], BS)
    table = block_table(rows, STREAMS, trash=999)
    assert table.shape == (STREAMS, 2, 3)
    assert list(table[1, 0]) == [b.block_id for b in rows[0].blocks[1]]
    assert list(table[4, 1]) == [rows[1].blocks[4][0].block_id, 999, 999]


def test_failed_growth_gives_back_every_block_taken_in_the_call():
    pool = _pool(n_blocks=2 * STREAMS + STREAMS // 2)
    rows = [PagedRow.empty(o, 0, STREAMS) for o in (1, 2, 3)]
    grow(pool, rows[:2], [BS, BS], BS, "fp32")
    advance(pool, rows[:2], BS, [0, 0], BS)
    before = pool.stats.blocks_in_use()
    with pytest.raises(BlockPoolExhaustedError):
        grow(pool, rows, [1, 1, 1], BS, "fp32")  # row 1 fits, row 2 does not
    assert pool.stats.blocks_in_use() == before
    for row in rows[:2]:
        _check(pool, row)
    assert rows[2].n_blocks == 0 and pool.blocks_for(3) == []


def test_free_returns_own_blocks_only():
    pool = _pool()
    rows = [PagedRow.empty(1, 0, STREAMS), PagedRow.empty(2, 0, STREAMS)]
    _feed(pool, rows, 6)
    shared = rows[0].blocks[0][0]
    rows[1].blocks[0].insert(0, shared)  # a block row 2 reads but does not own
    free(pool, rows)
    assert pool.stats.blocks_in_use() == 0
    assert all(r.tokens == 0 and r.n_blocks == 0 and len(r.blocks) == STREAMS for r in rows)
