"""The rows of a paged batch and the pool blocks each one holds.

A row is one owner's place in a :class:`~veloxquant_mlx.memory.paged_batch.PagedKVBatch`.
It holds, per layer and per stream (keys at ``2 * layer``, values at
``2 * layer + 1``), exactly ``ceil(tokens / block_size)`` blocks with exact
``n_used``, and mirrors their ids in a numpy array so that block tables are
built by slicing, not by walking Python lists. This module is that
bookkeeping: growing rows before a model call (all-or-nothing), counting the
call's columns into ``n_used``, building the batch's block table, freeing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator
from veloxquant_mlx.memory.pool_kv_common import allocate_kv, free_past


@dataclass(slots=True)
class PagedRow:
    """One owner's place in a batch.

    Invariant: every ``blocks[s]`` (``s = 2 * layer`` keys, ``2 * layer + 1``
    values) has ``ceil(tokens / block_size)`` blocks with exact ``n_used``,
    and ``ids[s, :len(blocks[s])]`` are their ids.
    """

    owner: int
    pad: int = 0  # leading padding columns still to be fed (prefill)
    tokens: int = 0
    blocks: list[list[Block]] = field(default_factory=list)
    ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    # (i, block i of every stream): the blocks a decode call's n_used update touches,
    # the same ones for block_size calls in a row. Cleared whenever ``blocks`` is
    # replaced or cut.
    column: tuple[int, list[Block]] | None = None

    @classmethod
    def empty(cls, owner: int, pad: int, n_streams: int) -> PagedRow:
        """A row holding no block yet, ``pad`` padding columns to feed first."""
        return cls(owner, pad, 0, [[] for _ in range(n_streams)],
                   np.zeros((n_streams, 4), np.int32))

    @property
    def n_blocks(self) -> int:
        """Blocks per layer and stream."""
        return len(self.blocks[0])

    def blocks_at(self, i: int) -> list[Block]:
        """Block ``i`` of every stream (keys and values of every layer)."""
        if self.column is None or self.column[0] != i:
            self.column = (i, [stream[i] for stream in self.blocks])
        return self.column[1]

    def mirror_ids(self, held: int) -> None:
        """Copy the ids of the blocks from index ``held`` on into ``ids``."""
        count = len(self.blocks[0])
        self._fit_ids(held, count)
        if count > held:  # one array for every stream (a slice assignment each is slow)
            self.ids[:, held:count] = np.array([[b.block_id for b in stream[held:count]]
                                                for stream in self.blocks], np.int32)

    def add_blocks(self, k_new: list[Block], v_new: list[Block]) -> None:
        """Append one allocation's blocks: ``need`` per layer, layer after layer."""
        layers, held = len(self.blocks) // 2, len(self.blocks[0])
        need = len(k_new) // layers
        for new, streams in ((k_new, self.blocks[0::2]), (v_new, self.blocks[1::2])):
            if need == 1:  # a decode row's next block: no slicing
                for stream, block in zip(streams, new, strict=True):
                    stream.append(block)
                continue
            for layer, stream in enumerate(streams):
                stream.extend(new[layer * need: (layer + 1) * need])
        # The ids straight from the two flat lists: walking the 2 x layers
        # streams again costs ~40 us a row on this CPU.
        self._fit_ids(held, held + need)
        self.ids[0::2, held:held + need] = np.array(
            [b.block_id for b in k_new], np.int32).reshape(layers, need)
        self.ids[1::2, held:held + need] = np.array(
            [b.block_id for b in v_new], np.int32).reshape(layers, need)

    def _fit_ids(self, held: int, count: int) -> None:
        """Room in ``ids`` for ``count`` blocks per stream, the first ``held`` kept."""
        if count > self.ids.shape[1]:
            grown = np.zeros((self.ids.shape[0], max(2 * self.ids.shape[1], count)), np.int32)
            grown[:, :held] = self.ids[:, :held]
            self.ids = grown


def grow(pool: BlockPoolAllocator, rows: Sequence[PagedRow], real: Sequence[int],
         block_size: int, fmt: str) -> None:
    """Give every row the blocks its next ``real`` tokens need; all-or-nothing.

    Raises:
        BlockPoolExhaustedError: Some row did not fit; blocks taken here are back.
    """
    # Most calls grow few rows (a decode row needs a block every block_size
    # steps): pick them out first, without a pool call for the others.
    growing = [(row, need) for row, n in zip(rows, real, strict=True)
               if (need := -(-(row.tokens + n) // block_size) - len(row.blocks[0])) > 0]
    if not growing:
        return
    taken: list[tuple[PagedRow, int]] = []
    try:
        for row, need in growing:
            layers = len(row.blocks) // 2
            k_new, v_new = allocate_kv(pool, row.owner, layers * need * block_size, fmt)
            taken.append((row, row.n_blocks))
            row.add_blocks(k_new, v_new)
    except BaseException:
        # ids past a row's blocks mean nothing (see PagedRow), so only blocks go back.
        for row, keep in taken:
            row.column = None
            for s in range(0, len(row.blocks), 2):
                free_past(pool, row.blocks[s], row.blocks[s + 1], keep)
        raise


def advance(pool: BlockPoolAllocator, rows: Sequence[PagedRow], n: int,
            lead: Sequence[int], block_size: int) -> None:
    """Count a call's ``n`` columns (``lead`` of them padding) into rows and ``n_used``."""
    bs = block_size
    for row, p in zip(rows, lead, strict=True):
        old, row.pad = row.tokens, row.pad - p
        row.tokens += n - p
        # Every layer's keys and values of a row hold the same tokens: block
        # i of all its streams takes one n_used, set in one pool call.
        for i in range(old // bs, -(-row.tokens // bs)):
            pool.set_used(row.blocks_at(i), min(row.tokens - i * bs, bs))


def block_table(rows: Sequence[PagedRow], n_streams: int, trash: int) -> np.ndarray:
    """``(streams, rows, blocks)`` ids of every row's blocks, ``trash`` past them."""
    width = max(r.n_blocks for r in rows)
    table = np.full((n_streams, len(rows), width), trash, np.int32)
    for i, row in enumerate(rows):
        table[:, i, : row.n_blocks] = row.ids[:, : row.n_blocks]
    return table


def free(pool: BlockPoolAllocator, rows: Sequence[PagedRow]) -> None:
    """Return the rows' own blocks to the pool; the rows stay, empty."""
    # Only a row's own blocks: shared prefix blocks (see PagedKVBatch.share_prefix)
    # belong to the prefix cache, which drops the row's references on its own.
    blocks = [b for row in rows for stream in row.blocks for b in stream
              if b.owner == row.owner]
    if blocks:
        pool.free(blocks)
    for row in rows:
        row.blocks = [[] for _ in row.blocks]
        row.tokens, row.column = 0, None
