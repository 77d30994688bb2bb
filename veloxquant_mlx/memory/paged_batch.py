"""Batched mlx-lm KV caches whose keys and values live in the pool's blocks.

A :class:`PagedKVBatch` is the rows of one model call (a decode batch, or a
group of prompts prefilling together); its ``caches`` are one
:class:`PagedLayerCache` per model layer, the objects mlx-lm's attention
talks to. Each row is one request (an *owner*) and holds, per layer and per
stream (``"k"``/``"v"``), exactly ``ceil(tokens / block_size)`` pool blocks;
their slots in the :class:`~veloxquant_mlx.memory.kv_arena.KVArena` are where
its keys and values are. Nothing else holds KV::

    row a: 37 tokens   layer l keys -> blocks [12, 40, 7]   (3 x 16 slots, 11 used in 7)
    row b:  5 tokens   layer l keys -> blocks [3]
    one model call of n columns, layer l:
      gather  arena[:, table_l]  -> (rows, H_kv, longest_blocks * block_size, D)   transient
              (a q8/q4 arena decodes its codes to the compute dtype here)
      append  the call's own n new keys/values of every row (attention sees both)
      mask    stored key j of row r visible  <=>  j < stored_r;  new column c' to
              query c  <=>  c' <= c and c' is not left padding
    after the last layer: ONE scatter writes every layer's new keys and values
    into their slots (padding columns -> the trash block)

    a decode batch with ``write_back`` > 1 holds its decode columns instead
    (:mod:`~veloxquant_mlx.memory.write_back`): attention appends the held
    columns to the gathered ones, and they are written ``write_back`` calls
    at a time; between two writes the block tables and the stored-token mask
    do not change, so they are built once, not every step

Rows are right-padded in the gathered buffer (a row's tokens start at
column 0), so RoPE positions are ``offset`` and a row's padding is never
stored. Left padding of a prefill group (``left_padding``) is consumed
column by column: those columns are written to the trash block and take no
position. ``filter`` (rows leave) frees the leaving rows' blocks at once;
``extend`` (rows join) moves rows over without copying any KV.

Each model call is *begun* once, by whichever of ``make_mask`` or the first
layer's ``update_and_fetch`` comes first: that allocates the blocks the call
needs (all-or-nothing), and fixes the call's slots, block tables and mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.kv_arena import KVArena
from veloxquant_mlx.memory.paged_layer_cache import PagedLayerCache
from veloxquant_mlx.memory.paged_rows import PagedRow, advance, block_table, free, grow
from veloxquant_mlx.memory.write_back import HeldColumns


class PagedKVBatch:
    """Rows sharing model calls; see the module docstring.

    Args:
        arena: The pool's KV arena.
        owners: Per row, its owner id (a fresh row) or a request's
            :class:`PagedRow` (its blocks, e.g. a
            :class:`~veloxquant_mlx.memory.request_blocks.RequestBlocks`'s row).
        left_padding: Leading padding columns of each row (prefill groups).
        fast_attention: Attend through :mod:`~veloxquant_mlx.memory.paged_attention`
            on the CPU (float32 logits within ~1e-6 of mlx-lm's); False keeps
            mlx-lm's own attention, bit-identical to its stock ``KVCache``.
        write_back: Decode columns (one-column calls) held out of the arena
            before one scatter writes them all; 1 writes every call.

    Raises:
        ValueError: ``left_padding`` does not have one entry per owner.
    """

    def __init__(self, arena: KVArena, owners: Sequence[int | PagedRow],
                 left_padding: Sequence[int] | None = None,
                 fast_attention: bool = True, write_back: int = 1) -> None:
        pads = [0] * len(owners) if left_padding is None else [int(p) for p in left_padding]
        if len(pads) != len(owners):
            raise ValueError(f"left_padding has {len(pads)} entries for {len(owners)} owners")
        self.arena = arena
        self.fast_attention = fast_attention
        self.pool = arena.pool
        self.bs = arena.block_size
        self.n_streams = 2 * arena.layout.n_layers
        self._fmt = arena.format_tag  # one format per arena: a row's blocks never mix formats
        self.rows = [_row(o, p, self.n_streams) for o, p in zip(owners, pads, strict=True)]
        self.columns = 0  # columns begun, over all model calls
        # Each row's RoPE position of a call's first column: before the call
        # begun last (offset_pre) and after it (offset_next).
        self.offset_pre = self._offsets()
        self.offset_next = self.offset_pre
        # Per layer: the (2 x rows, blocks) ids each call reads, and their gather index.
        self._tables: list[mx.array] = []
        self._gather_index: list[tuple[mx.array, mx.array]] = []
        self._slots: mx.array | None = None
        self._mask: mx.array | None = None
        self._mask_parts: tuple[mx.array | None, mx.array] | None = None
        self.any_past = False  # some row had stored tokens before the call
        self._all_past = False
        # Stored tokens of every row when all rows stored the same number (else None).
        self.same_past: int | None = None
        # The call begun last needs no mask (see _set_maskless): attention gets the
        # stored keys cut to ``same_past`` columns.
        self.maskless = False
        self._width = 0
        self._past: mx.array | None = None  # tokens each row stored before the call
        self._lead: mx.array | None = None  # left-padding columns each row feeds in the call
        self._pending: list[mx.array] = []  # the call's new keys+values, layer by layer
        self.held = HeldColumns(arena.layout.n_layers, write_back, len(self.rows))
        self._holding = False  # the call begun last holds its column (a decode call)
        self._view_stale = True  # tables and stored mask to rebuild at the next call
        heads = arena.layout.n_kv_heads
        self._heads_g = mx.arange(heads)[None, :, None]
        self._heads_w = mx.arange(heads)[:, None]
        self.caches = [PagedLayerCache(self, i) for i in range(arena.layout.n_layers)]

    # -- bookkeeping -------------------------------------------------------------

    @property
    def owners(self) -> list[int]:
        """The owner of each row, in row order."""
        return [r.owner for r in self.rows]

    def real_tokens(self, i: int) -> int:
        """Tokens row ``i`` holds (in every layer)."""
        return self.rows[i].tokens

    @property
    def write_back(self) -> int:
        """Decode columns held before one write (1: every call writes)."""
        return self.held.limit

    @write_back.setter
    def write_back(self, limit: int) -> None:
        self.flush()
        self.held = HeldColumns(self.arena.layout.n_layers, limit, len(self.rows))

    def n_blocks_held(self) -> int:
        """Blocks every row holds, over all layers and both streams."""
        return sum(r.n_blocks * self.n_streams for r in self.rows)

    def _offsets(self) -> mx.array:
        return mx.array([r.tokens - r.pad for r in self.rows], dtype=mx.int32)

    def begin(self, n: int) -> None:
        """Start a model call of ``n`` columns: blocks, slots, tables, mask data.

        Raises:
            BlockPoolExhaustedError: A row's growth does not fit; nothing changed.
        """
        rows = self.rows
        hold = self.held.limit > 1 and n == 1 and not any(r.pad for r in rows)
        if self.held.count and (not hold or self.held.count >= self.held.limit):
            self.flush()
        lead = [min(r.pad, n) for r in rows]
        grow(self.pool, rows, [n - p for p in lead], self.bs, self._fmt)
        if self.arena.ensure_ids():  # the trash block moved
            self._view_stale = True
        # Tokens each row stored before the call: only a new view needs them.
        past = (np.array([r.tokens for r in rows], np.int64)
                if self._view_stale or not hold else None)
        self.offset_pre = self.offset_next
        advance(self.pool, rows, n, lead, self.bs)
        # A holding call adds one column to every row (no padding): no host array to build.
        self.offset_next = self.offset_pre + 1 if hold else self._offsets()
        self._pending, self._holding = [], hold
        self.columns += n
        if hold:  # the tables only change when the held columns are written
            if past is not None:
                self._set_view(past - self.held.per_row(), None)
            self.held.open()
            self._mask, self._mask_parts = None, None
            self._set_maskless(n, not self.held.start.any())
            return
        self._set_view(past, np.array(lead, np.int64), n)
        self._set_maskless(n, not any(lead))

    def _set_maskless(self, n: int, own_columns_visible: bool) -> None:
        """Whether every row of this one-column call sees every key it is given.

        True when all rows stored the same number of tokens and see all of the
        call's own (or held) columns: attention then gets no mask and the
        stored keys cut to that number. That is how mlx-lm calls attention for
        one sequence, and on a GPU only a call without an array mask runs
        MLX's fused decode attention (CUDA: one kernel instead of ~8 a layer).
        """
        self.maskless = n == 1 and self.same_past is not None and own_columns_visible

    def owns_mask(self, mask: object) -> bool:
        """Whether ``mask`` is this batch's own mask of the call begun last."""
        return mask is not None and mask is self._mask

    def _set_view(self, past: np.ndarray, lead: np.ndarray | None, n: int = 0) -> None:
        """Tables, slots and mask data of a call over ``past`` stored tokens per row.

        ``lead`` (with ``n``): the call writes its own ``n`` columns, ``lead``
        of them left padding, when it ends; None: they are held.
        """
        rows, bs, trash = self.rows, self.bs, self.arena.trash
        layers = self.n_streams // 2
        table = block_table(rows, self.n_streams, trash)
        if lead is not None:
            cols = np.arange(n)[None, :]
            valid = cols >= lead[:, None]
            pos = np.where(valid, past[:, None] + cols - lead[:, None], 0)
            blk = table[:, np.arange(len(rows))[:, None], pos // bs]
            slots = np.where(valid[None], blk * bs + pos % bs, trash * bs)
            self._slots = mx.array(slots.reshape(layers, -1).astype(np.int32))
            self._lead = mx.array(lead.astype(np.int32))
        # Per layer: keys' rows then values' rows, as write_and_gather stacks them.
        # Attention reads only the blocks that held tokens before the call (at
        # least one): the blocks just grown for this call's columns are not
        # written yet, so gathering them would only add masked keys (a second
        # 512-token prefill chunk would attend over 1,024 stored columns).
        stored = max(1, -(-int(past.max()) // bs))
        table = table[..., :stored].reshape(layers, 2 * len(rows), stored)
        # Split into views once (indexing one array by layer would add a gather
        # per layer to every step's graph: a kernel launch each on a GPU).
        self._tables = [t.squeeze(0) for t in mx.split(mx.array(table), layers)]
        self._gather_index = [self.arena.gather_index(self._heads_g, t) for t in self._tables]
        self._width, self._mask, self._mask_parts = stored * bs, None, None
        self._past = mx.array(past.astype(np.int32))
        self.same_past = int(past[0]) if len(past) and (past == past[0]).all() else None
        self.any_past = bool(past.any())
        self._all_past = bool((past == self._width).all())  # every stored column visible
        self._view_stale = lead is not None

    def flush(self) -> None:
        """Write every held column into the arena, in one scatter (see ``write_back``)."""
        held = self.held
        if not held.count:
            return
        bs, count = self.bs, held.count
        cols = np.arange(count)[None, :]
        valid = cols >= held.start[:, None]
        tokens = np.array([r.tokens for r in self.rows], np.int64)
        pos = np.where(valid, tokens[:, None] - count + cols, 0)
        slots = np.empty((self.n_streams, len(self.rows), count), np.int64)
        for i, row in enumerate(self.rows):
            slots[:, i] = row.ids[:, pos[i] // bs] * bs + pos[i] % bs
        slots = np.where(valid[None], slots, self.arena.trash * bs)
        self.arena.store(self._heads_w, mx.array(slots.reshape(1, -1).astype(np.int32)),
                         held.stacked())
        held.clear(len(self.rows))
        self._view_stale = True

    def mask(self, n: int) -> mx.array:
        """``(rows, 1, n, keys + n)`` boolean mask of the call begun last.

        Keys are every row's stored tokens (gathered, ``keys`` columns) then the
        call's own ``n`` columns (a holding call: the held columns, its own
        last, ``keys + held``). Query ``c`` of row ``r`` sees the stored keys
        ``j < past_r`` and the call's columns ``c' <= c`` that are not left
        padding; a padding query sees its own column only (its output is
        never used, but a row with no visible key would be NaN).
        """
        if self._mask is None:
            stored, fresh = self.mask_parts(n)
            stored = mx.ones((1, 1, 1, 1), mx.bool_) if stored is None else stored
            stored = mx.broadcast_to(stored, (len(self.rows), 1, fresh.shape[2], self._width))
            self._mask = mx.concatenate([stored, fresh], axis=-1)
        return self._mask

    def write_and_gather(self, layer: int, new: mx.array) -> tuple[mx.array, mx.array]:
        """Every row's stored keys and values, and the new ones; store the call's later.

        Keys and values travel stacked: ``new`` is the call's own columns,
        ``(2 x rows, H_kv, n, D)``, keys' rows then values' rows, and both
        results are stacked the same way: the stored ``(2 x rows, H_kv, keys,
        D)``, then the call's own columns, or for a call that holds its
        column (``write_back``) the held columns with the call's last.

        The stored tokens come out of the arena with one gather (keys' and
        values' tables are stacked). The call's own columns are not written
        first (attention sees them next to the stored ones): every layer's
        new columns go into the arena in ONE scatter, after the last layer
        (a holding call writes nothing: see :meth:`flush`). On a GPU a buffer
        that in-flight kernels still read cannot be updated in place, so each
        scatter copies the whole arena; one per model call instead of one per
        layer, and one per ``write_back`` decode calls, keep that cost small.
        """
        # A quantized arena decodes here; the call's own columns stay exact
        # until they are stored.
        stored = self.arena.gather(self._gather_index[layer], new.shape[0], self._width)
        return stored, self._write(layer, new)

    def write_paged(self, layer: int, new: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """:meth:`write_and_gather` without the gather: the arena's data as the call
        reads it, ``(H_kv, slots, D)``, the layer's ``(2 x rows, blocks)`` block table
        (keys' rows, then values'), and the new (or held) columns. For attention that
        reads the blocks where they lie (a float arena: a quantized one must decode)."""
        data = self.arena.data  # before this call's scatter, which replaces it
        return data, self._tables[layer], self._write(layer, new)

    def _write(self, layer: int, new: mx.array) -> mx.array:
        """Hold or queue the call's columns of ``layer``; the columns attention sees."""
        if self._holding:
            return self.held.append(layer, new)
        self._pending.append(new)
        if layer == len(self.caches) - 1:
            self._store_pending(new.shape[1], new.shape[3])
        return new

    @property
    def holding(self) -> bool:
        """Whether the call begun last holds its column (see ``write_back``)."""
        return self._holding

    @property
    def width(self) -> int:
        """Stored columns a row's attention reads in the call begun last (whole blocks:
        the longest row's, the rest masked)."""
        return self._width

    def mask_parts(self, n: int) -> tuple[mx.array | None, mx.array]:
        """:meth:`mask` in two parts: stored ``(rows, 1, 1, keys)``, new ``(rows, 1, n, n)``.

        The stored part is None when every row sees every stored column (a
        lone prompt's later chunk): attention then skips masking those scores.
        A holding call's new part is ``(rows, 1, 1, held)``: each row sees its
        own held columns.
        """
        if self._mask_parts is None:
            stored = None if self._all_past else (
                mx.arange(self._width)[None, None, None, :] < self._past[:, None, None, None])
            if self._holding:
                self._mask_parts = (stored, self.held.mask())
                return self._mask_parts
            c = mx.arange(n)
            causal = c[None, :] <= c[:, None]
            real = c[None, None, :] >= self._lead[:, None, None]
            own = (c[None, :] == c[:, None])[None]
            self._mask_parts = (stored, (causal[None] & (real | own))[:, None])
        return self._mask_parts

    def _store_pending(self, heads: int, dim: int) -> None:
        """Scatter every layer's new keys and values of this call into their slots."""
        new = mx.concatenate(self._pending).transpose(1, 0, 2, 3).reshape(heads, -1, dim)
        self.arena.store(self._heads_w, self._slots.reshape(1, -1), new)
        self._pending = []

    # -- rows in and out -----------------------------------------------------------

    def share_prefix(self, i: int, blocks: Sequence[Sequence[Block]]) -> None:
        """Start row ``i`` on already computed full blocks (a cached prompt prefix).

        The row's table begins with ``blocks`` (``blocks[j][s]``: position
        ``j``, stream ``s``), which it reads but never writes or frees; its
        first model call then feeds the tokens after them. Call before the
        batch's first model call.

        Raises:
            ValueError: The batch already ran, or a position lacks a stream.
        """
        row = self.rows[i]
        if self.columns or row.tokens:
            raise ValueError("share_prefix() must come before the row's first model call")
        if any(len(position) != self.n_streams for position in blocks):
            raise ValueError(f"each shared position needs {self.n_streams} blocks "
                             "(every layer's keys and values)")
        row.blocks = [[position[s] for position in blocks] for s in range(self.n_streams)]
        row.tokens, row.column = len(blocks) * self.bs, None
        row.mirror_ids(0)
        self.offset_pre = self.offset_next = self._offsets()


    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (in that order); the others' blocks go back to the pool now."""
        keep = [int(i) for i in keep]
        kept = set(keep)
        free(self.pool, [r for i, r in enumerate(self.rows) if i not in kept])
        self.rows = [self.rows[i] for i in keep]
        self.held.keep(keep)  # a leaving row's held columns go with its blocks
        self.offset_next = self._offsets()
        self._view_stale = True

    def extend(self, other: PagedKVBatch) -> None:
        """Take ``other``'s rows (and blocks) after this batch's rows; no KV is copied.

        Raises:
            ValueError: ``other`` is on another arena (whose blocks may be of
                another format: rows of one batch share one format).
        """
        if other.arena is not self.arena:
            raise ValueError("extend() takes a PagedKVBatch of the same arena")
        other.flush()
        self.held.add_rows(len(other.rows))
        self.rows += other.rows
        other.rows = []
        other.held.clear(0)
        self.offset_next = self._offsets()
        self._view_stale = True

    def release(self) -> None:
        """Return every row's blocks to the pool (the rows stay, empty)."""
        free(self.pool, self.rows)
        self.held.clear(len(self.rows))
        self._view_stale = True

    def close(self) -> None:
        """Return every row's blocks and let the batch go now; its caches are unusable after.

        A batch and its layer caches reference each other, so a batch dropped
        without this waits for Python's cycle collector, and so does the device
        memory of its last call's arrays: a prefill chunk's gathered keys and
        values, up to ``write_back`` held decode columns of every row and layer
        (on the served tiny model, ~260 KB stays after every request has ended
        until a collection runs).
        """
        self.release()
        for cache in self.caches:
            cache.batch, cache.parts = None, None


def _row(owner: int | PagedRow, pad: int, n_streams: int) -> PagedRow:
    """A batch's row: a request's own table, or a fresh one for an owner id."""
    if isinstance(owner, PagedRow):
        owner.pad, owner.column = pad, None
        return owner
    return PagedRow.empty(owner, pad, n_streams)
