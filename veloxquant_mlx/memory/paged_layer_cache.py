"""One model layer's view of a paged batch: the cache object mlx-lm's attention calls.

mlx-lm's attention hands each layer's new keys and values to its cache and
attends over what comes back. :class:`PagedLayerCache` passes them on to the
layer's :class:`~veloxquant_mlx.memory.paged_batch.PagedKVBatch` (which
stores them in pool blocks and gathers the rows' stored ones), begins the
batch's model call at the first layer that needs it, and hands
:mod:`~veloxquant_mlx.memory.paged_attention` the stored and new parts
separately so the CPU's attention can skip concatenating them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

# A call's stored and new keys and values (each stacked: keys' rows, then values') and
# their masks; the stored part None when nothing was stored yet.
StackedParts = tuple[mx.array | None, mx.array, mx.array | None, mx.array | None]
# The same with the stored part where it lies: the arena's data, the layer's block table
# and the stored columns read along it (whole blocks, masked), as paged_decode_attention
# takes them.
PagedParts = tuple[mx.array, mx.array, int, mx.array, mx.array | None, mx.array | None]


class PagedLayerCache(_mlx_cache._BaseCache):
    """One layer's view of a :class:`PagedKVBatch` (what mlx-lm's attention calls).

    Args:
        batch: The batch.
        layer: This layer's index.
    """

    def __init__(self, batch: Any, layer: int) -> None:
        # batch: the PagedKVBatch that made this cache (not imported: the batch imports
        # this module to build its layers' caches).
        self.batch = batch
        self.layer = layer
        self.written = 0  # columns this layer appended
        self.parts: tuple[mx.array, mx.array] | None = None  # last call's stored, new (stacked)

    @property
    def offset(self) -> mx.array:
        """Each row's position of this layer's next column (RoPE)."""
        b = self.batch
        return b.offset_next if self.written == b.columns else b.offset_pre

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``rows, H, n, D``); return the rows' gathered KV.

        Raises:
            BlockPoolExhaustedError: The call's growth does not fit; nothing changed.
        """
        return self.update_and_fetch_stacked(mx.concatenate([keys, values]))

    def update_and_fetch_stacked(self, new: mx.array) -> tuple[mx.array, mx.array]:
        """:meth:`update_and_fetch` of keys and values stacked (keys' rows, then values').

        What :mod:`~veloxquant_mlx.compiled_decode` calls: its compiled half
        stacks them, so the step's graph has one op less per layer here.
        """
        b = self.batch
        self._begin(new.shape[2])
        self.written = b.columns
        stored, new = b.write_and_gather(self.layer, new)
        if b.fast_attention:  # taken (and dropped) by this call's attention
            self.parts = (stored, new)
        rows = new.shape[0] // 2
        if b.maskless:  # a view: only the columns every row stored (no mask needed)
            stored = stored[:, :, :b.same_past]
        # Lazy: never computed when attention takes the parts (stacked_parts).
        both = mx.concatenate([stored, new], axis=2)
        return both[:rows], both[rows:]

    def _begin(self, n: int) -> None:
        """Begin a call of ``n`` columns unless it is begun: a layer that already wrote
        its columns of the batch's current call is the first of the next one."""
        if self.written == self.batch.columns:
            self.batch.begin(n)

    def paged_parts(self, new: mx.array, mask: mx.array | None,
                    max_keys: int) -> PagedParts | None:
        """Store ``new`` (keys over values) and return the layer's KV with the stored
        part where it lies in the arena, for attention that reads the blocks there.

        None, with nothing stored (the call may have begun), where that does not apply:
        a quantized arena (its blocks decode in the gather), no stored tokens yet, a
        mask other than the batch's own, or more than ``max_keys`` keys a row; the
        caller then goes through :meth:`update_and_fetch_stacked`.
        """
        b = self.batch
        self._begin(new.shape[2])
        self.parts = None
        maskless = mask is None and b.maskless
        if b.arena.quantized or not b.any_past or not (maskless or b.owns_mask(mask)):
            return None
        fresh_columns = b.held.count if b.holding else new.shape[2]
        if b.width + fresh_columns > max_keys:
            return None
        self.written = b.columns
        arena, table, fresh = b.write_paged(self.layer, new)
        # The stored part as stacked_parts gives it (whole blocks, masked), so both paths
        # sum the same scores in the same order: the same logits, bit for bit.
        stored_mask, fresh_mask = b.mask_parts(new.shape[2])
        return arena, table, b.width, fresh, stored_mask, None if maskless else fresh_mask

    def stacked_parts(self, mask: mx.array | None) -> StackedParts | None:
        """The last call's stored and new keys and values, each stacked (keys' rows over
        values'), and each part's mask.

        None unless ``mask`` is the batch's own mask of that call, or None for
        a maskless call (a model that passed another mask attends over the
        concatenated arrays). A maskless call's stored part keeps its whole
        blocks, masked (cutting them would copy them); its new part needs none.
        The stored part is None when nothing was stored yet (a first prefill chunk).
        """
        b, parts, self.parts = self.batch, self.parts, None  # held no longer than the call
        maskless = mask is None and b.maskless
        if parts is None or not (maskless or b.owns_mask(mask)):
            return None
        stored, new = parts
        stored_mask, new_mask = b.mask_parts(new.shape[2])
        if maskless:
            new_mask = None
        if not b.any_past:  # the gather is never run
            return None, new, None, new_mask
        return stored, new, stored_mask, new_mask

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """Boolean mask hiding other rows' padding and future columns.

        None for a call whose rows all see every key they get
        (:attr:`PagedKVBatch.maskless`).
        """
        b = self.batch
        if self.written == b.columns:
            b.begin(N)
        return None if b.maskless else b.mask(N)

    def is_trimmable(self) -> bool:
        """False: rows only grow, then leave."""
        return False

    def empty(self) -> bool:
        """True until the batch's first model call."""
        return self.batch.columns == 0

    @property
    def nbytes(self) -> int:
        """0: the KV lives in the arena, accounted as the rows' pool blocks."""
        return 0


def split_parts(stored: mx.array | None, new: mx.array, stored_mask: mx.array | None,
                new_mask: mx.array | None) -> tuple[list, list, list]:
    """Stacked parts (:meth:`PagedLayerCache.stacked_parts`) as lists of keys, values and
    masks, the stored part first when there is one."""
    rows = new.shape[0] // 2
    keys, values = new[:rows], new[rows:]
    if stored is None:
        return [keys], [values], [new_mask]
    return [stored[:rows], keys], [stored[rows:], values], [stored_mask, new_mask]
