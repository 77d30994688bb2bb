"""A batched mlx-lm KV cache whose every row draws its growth from a block pool.

:class:`PoolBackedBatchKVCache` speaks the protocol of mlx-lm's
``BatchKVCache`` (left-padded rows, per-row ``offset``, ``filter``,
``extend``, ``extract``, ``merge``, ``prepare``/``finalize``, ``make_mask``)
so one model call decodes many requests. Each row belongs to one request
(an *owner*), and the blocks for that row's real tokens are checked out of
the shared pool under that owner, per layer, on the ``"k"`` and ``"v"``
streams, exactly as :class:`~veloxquant_mlx.memory.pool_backed.PoolBackedKVCache`
does for a single request::

    buffer (B=3, one layer)          _idx = 7 (columns written)
               col 0 1 2 3 4 5 6
    row 0 (owner 11)  . . a a a a a   left pad 2 -> 5 real tokens -> 1 block
    row 1 (owner 12)  b b b b b b b   left pad 0 -> 7 real tokens -> 1 block
    row 2 (owner 13)  . . . . . c c   left pad 5 -> 2 real tokens -> 1 block

* Padding columns are never accounted: a row holds blocks for its real
  tokens only (``ceil(real / block_size)`` rounded up to ``step`` chunks),
  and every block's ``n_used`` equals the real tokens in it.
* ``filter`` (rows leave) frees the leaving rows' blocks of this layer at
  once; ``extend``/``merge`` (rows join) move the joining rows' blocks over,
  so the pool's per-owner count always equals what the arrays hold.
* The buffer grows in ``step=256`` columns like mlx-lm's; its padding is the
  price of batching rows of unequal length (``filter`` trims shared padding).

A row's real token count is kept as a Python int mirror (no device sync per
step): ``real = _idx - left_pad - right_pad`` (right padding only between
``prepare(right_padding=...)`` and ``finalize()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.base import create_causal_mask

from veloxquant_mlx.exceptions import PoolArgumentError, VeloxQuantError
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator
from veloxquant_mlx.memory.leases import require_owned
from veloxquant_mlx.memory.pool_backed import PoolBackedKVCache
from veloxquant_mlx.memory.pool_kv_common import (
    DEFAULT_BUFFER_STEP,
    ContiguousKVBuffer,
    allocate_kv,
    check_kv_input,
    check_positive,
    check_trim,
    format_of,
    free_past,
    mark_used,
    require_plain_kv_model,
    tokens_to_grow,
)


@dataclass(slots=True)
class RowBlocks:
    """The blocks one row (one owner) holds in one layer.

    Invariant: ``len(k) == len(v)``, they cover ``tokens`` real tokens, and
    block ``i`` has ``n_used == clamp(tokens - i * block_size, 0, block_size)``.
    """

    owner: int
    tokens: int = 0
    k: list[Block] = field(default_factory=list)
    v: list[Block] = field(default_factory=list)


class PoolBackedBatchKVCache(ContiguousKVBuffer):
    """mlx-lm ``BatchKVCache`` whose rows account their tokens in a shared pool.

    Args:
        pool: The shared pool.
        owners: One owner id per row (a request's id; every layer of one
            request uses the same id).
        left_padding: Padding columns each row starts with (default none).
        step: Tokens of block accounting added per growth step; defaults to
            ``pool.config.block_size``.

    Raises:
        ValueError: ``left_padding`` does not have one entry per owner, or
            ``step`` is not a positive int.
    """

    step = DEFAULT_BUFFER_STEP  # buffer growth in columns, as mlx-lm's BatchKVCache

    def __init__(
        self,
        pool: BlockPoolAllocator,
        owners: Sequence[int],
        left_padding: Sequence[int] | None = None,
        step: int | None = None,
    ) -> None:
        pads = [0] * len(owners) if left_padding is None else [int(p) for p in left_padding]
        if len(pads) != len(owners):
            raise ValueError(f"left_padding has {len(pads)} entries for {len(owners)} owners")
        self.pool = pool
        self.grow_step = check_positive("step", pool.config.block_size if step is None else step)
        self._bs = pool.config.block_size
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._idx = 0
        self._lp = pads
        self._rp: list[int] | None = None
        self.left_padding = mx.array(pads)
        self.offset = mx.array([-p for p in pads])
        self.rows = [RowBlocks(o) for o in owners]

    # -- accounting ------------------------------------------------------------

    @property
    def owners(self) -> list[int]:
        """The owner of each row, in row order."""
        return [r.owner for r in self.rows]

    def real_tokens(self, i: int) -> int:
        """Real (unpadded) tokens row ``i`` holds."""
        rp = self._rp[i] if self._rp is not None else 0
        return max(self._idx - self._lp[i] - rp, 0)

    def _account(self, dtype: mx.Dtype) -> None:
        """Bring every row's blocks to its real token count; all-or-nothing on growth.

        Raises:
            BlockPoolExhaustedError: Some row could not grow; blocks taken by
                this call are returned and no row changes.
        """
        bs, pool = self._bs, self.pool
        fmt = format_of(dtype)
        for row in self.rows:  # the blocks this call marks: never another owner's
            require_owned(row.k, row.owner, row.tokens // bs)
            require_owned(row.v, row.owner, row.tokens // bs)
        taken: list[tuple[RowBlocks, int]] = []
        try:
            for i, row in enumerate(self.rows):
                need = self.real_tokens(i)
                held = len(row.k) * bs
                if need > held:
                    k_new, v_new = allocate_kv(pool, row.owner,
                                               tokens_to_grow(need, held, self.grow_step), fmt)
                    taken.append((row, len(row.k)))
                    row.k.extend(k_new)
                    row.v.extend(v_new)
        except BaseException:
            for row, keep in taken:
                free_past(pool, row.k, row.v, keep)
            raise
        for i, row in enumerate(self.rows):
            self._settle(row, self.real_tokens(i))

    def _settle(self, row: RowBlocks, tokens: int) -> None:
        """Free whole blocks past ``tokens`` and set ``n_used`` of the changed blocks."""
        bs = self._bs
        if tokens < row.tokens:
            # Shrunk (trim): give back every block past the real tokens.
            free_past(self.pool, row.k, row.v, -(-tokens // bs))
        mark_used(row.k, row.v, min(row.tokens, tokens) // bs, tokens, bs)
        row.tokens = tokens

    def _free_rows(self, rows: Sequence[RowBlocks]) -> None:
        # Only blocks still checked out to the row's owner: after a pool.free_all(owner)
        # behind this cache's back the pool may have handed them to another request.
        blocks = [b for row in rows for b in (*row.k, *row.v) if b.owner == row.owner]
        if blocks:
            self.pool.free(blocks)
        for row in rows:
            row.k, row.v, row.tokens = [], [], 0

    def release(self) -> None:
        """Return this layer's blocks of every row to the pool and drop the rows' arrays."""
        self._free_rows(self.rows)

    def n_blocks_held(self) -> int:
        """K plus V blocks this layer holds over all rows."""
        return sum(len(r.k) + len(r.v) for r in self.rows)

    # -- mlx-lm cache protocol -------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``B, H, n, D``) to every row; return all columns.

        Raises:
            BlockPoolExhaustedError: A row's growth does not fit; nothing changed.
            PoolArgumentTypeError, PoolArgumentError: Input that cannot be
                written (not ``mx.array``s, not ``(B, H, n, D)`` with one row
                per owner); nothing changed.
        """
        check_kv_input(keys, values)
        if keys.shape[0] != len(self.rows):
            raise PoolArgumentError(
                f"keys have {keys.shape[0]} row(s) but this batch cache has {len(self.rows)}")
        prev, n = self._idx, keys.shape[2]
        self._idx = prev + n
        try:
            self._account(keys.dtype)
        except BaseException:
            self._idx = prev
            raise
        self._write_columns(prev, self._idx, keys, values, self.step)
        self.offset = self.offset + n
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Every written column of every row (padding included)."""
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Add left padding to an empty cache, or note right padding of the next prefill.

        Raises:
            ValueError: Left padding added to a cache that already holds tokens.
        """
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch cache")
            self._lp = [a + int(b) for a, b in zip(self._lp, left_padding, strict=True)]
            self.left_padding = mx.array(self._lp)
            self.offset = self.offset - mx.array([int(p) for p in left_padding])
        if right_padding is not None and max(right_padding) > 0:
            self._rp = [int(p) for p in right_padding]

    def finalize(self) -> None:
        """Turn the right padding of a prefill into left padding (rows right-justified)."""
        if self._rp is None:
            return
        pad = mx.array(self._rp)
        self.keys = _mlx_cache.dynamic_roll(self.keys, pad[:, None], axis=2)
        self.values = _mlx_cache.dynamic_roll(self.values, pad[:, None], axis=2)
        self.offset = self.offset - pad
        self._lp = [a + b for a, b in zip(self._lp, self._rp, strict=True)]
        self.left_padding = mx.array(self._lp)
        self._rp = None

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """Attention mask hiding each row's padding.

        With no padding at all the mask is what the single-request cache
        gives (``None`` for one token, ``"causal"`` otherwise), so a batch of
        one runs the very kernels of the single-request path.
        """
        if self._rp is None and not any(self._lp):
            return _mlx_cache.create_attention_mask(
                N, offset=self._idx, return_array=return_array, window_size=window_size)
        # Right padding needs no mask: it follows a row's real tokens, which
        # causality already hides it from (as in mlx-lm's BatchKVCache).
        return create_causal_mask(N, offset=self._idx, window_size=window_size,
                                  left_padding=self.left_padding)

    def filter(self, batch_indices) -> None:
        """Keep only the rows ``batch_indices`` (in that order); free the others' blocks.

        Raises:
            PoolArgumentError: An index is out of range or listed twice (a row
                and its blocks cannot be in the batch twice); nothing changed.
        """
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array)
                                 else batch_indices)]
        kept = set(keep)
        # Checked before any block is freed: a bad index must not cost rows their blocks.
        if len(kept) != len(keep) or not all(0 <= i < len(self.rows) for i in keep):
            raise PoolArgumentError(
                f"filter() takes distinct row indices in [0, {len(self.rows)}), got {keep}")
        self._free_rows([r for i, r in enumerate(self.rows) if i not in kept])
        self.rows = [self.rows[i] for i in keep]
        self._lp = [self._lp[i] for i in keep]
        if self._rp is not None:
            self._rp = [self._rp[i] for i in keep]
        index = mx.array(keep, dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values = self.keys[index], self.values[index]
        self.offset = self.offset[index]
        # Drop the padding columns every remaining row shares (only written ones:
        # mid-prefill, a row's padding may extend past the columns written so far).
        shift = min(min(self._lp, default=0), self._idx)
        if shift > 0:
            if self.keys is not None:
                self.keys = self.keys[..., shift:, :]
                self.values = self.values[..., shift:, :]
            self._idx -= shift
            self._lp = [p - shift for p in self._lp]
        self.left_padding = mx.array(self._lp)

    def extend(self, other: PoolBackedBatchKVCache) -> None:
        """Append ``other``'s rows (and their blocks) after this cache's rows.

        ``other`` is left empty: its rows and blocks now belong to this cache.

        Raises:
            VeloxQuantError: ``other`` is not a batch cache of the same pool,
                is this cache itself, or either cache has a prefill pending
                ``finalize``.
        """
        if other is self:
            raise VeloxQuantError(
                "a batch cache cannot extend itself (its rows would be emptied); "
                "extend it with another request's cache")
        if not isinstance(other, PoolBackedBatchKVCache) or other.pool is not self.pool:
            raise VeloxQuantError(
                "extend() takes a PoolBackedBatchKVCache of the same pool; build the "
                "joining request's caches with make_batch_caches(model, pool, owner)")
        if self._rp is not None or other._rp is not None:
            raise VeloxQuantError("finalize() the prefill before extending a batch cache")
        width = max(self._idx, other._idx)
        if self.keys is not None or other.keys is not None:
            parts = [self._right_justified(c, width, other) for c in (self, other)]
            self.keys = mx.concatenate([p[0] for p in parts], axis=0)
            self.values = mx.concatenate([p[1] for p in parts], axis=0)
        # Right-justified: a shorter cache's rows gain the difference as left padding.
        self._lp = ([p + width - self._idx for p in self._lp]
                    + [p + width - other._idx for p in other._lp])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.array(self._lp)
        self._idx = width
        self.rows = self.rows + other.rows
        other.rows, other._lp, other.keys, other.values, other._idx = [], [], None, None, 0
        other.offset = other.left_padding = mx.array([], dtype=mx.int32)

    def _right_justified(self, c, width: int, other) -> tuple[mx.array, mx.array]:
        """``c``'s buffers padded so their written columns end at ``width`` (same length)."""
        ref = self.keys if self.keys is not None else other.keys
        size = max(x.keys.shape[2] for x in (self, other) if x.keys is not None)
        size = max(size, width)
        k, v = c.keys, c.values
        if k is None:
            rows = len(c.rows)
            k = mx.zeros((rows, ref.shape[1], 0, ref.shape[3]), ref.dtype)
            vref = self.values if self.values is not None else other.values
            v = mx.zeros((rows, vref.shape[1], 0, vref.shape[3]), vref.dtype)
        k, v = k[..., : c._idx, :], v[..., : c._idx, :]
        left, right = width - c._idx, size - width
        if left or right:
            pad = [(0, 0), (0, 0), (left, right), (0, 0)]
            k, v = mx.pad(k, pad), mx.pad(v, pad)
        return k, v

    def extract(self, idx: int) -> PoolBackedKVCache:
        """Row ``idx`` as a *detached* single-request cache (a copy; the row stays).

        The copy holds no blocks (so nothing is counted twice); call
        ``attach(pool, owner)`` on it to account it.
        """
        lp = self._lp[idx]
        end = self._idx - (self._rp[idx] if self._rp is not None else 0)
        keys = mx.contiguous(self.keys[idx: idx + 1, :, lp:end])
        values = mx.contiguous(self.values[idx: idx + 1, :, lp:end])
        return PoolBackedKVCache.from_state((keys, values, end - lp))

    @classmethod
    def merge(cls, caches: Sequence[PoolBackedBatchKVCache]) -> PoolBackedBatchKVCache:
        """One batch cache holding the rows of ``caches`` in order (they are left empty).

        Raises:
            VeloxQuantError: No caches, or one that is not a batch cache of the
                first one's pool.
        """
        if not caches:
            raise VeloxQuantError("merge() needs at least one PoolBackedBatchKVCache")
        first = caches[0]
        if not isinstance(first, PoolBackedBatchKVCache):
            raise VeloxQuantError(
                f"merge() takes PoolBackedBatchKVCache instances, got {type(first).__name__}")
        merged = cls(first.pool, [], step=first.grow_step)
        for cache in caches:
            merged.extend(cache)
        return merged

    @property
    def state(self):
        """``(keys, values, offset, left_padding)`` of the written columns."""
        if self.keys is None:
            return None, None, self.offset, self.left_padding
        keys, values = self.keys_and_values()
        return keys, values, self.offset, self.left_padding

    @state.setter
    def state(self, v) -> None:
        raise VeloxQuantError(
            "PoolBackedBatchKVCache state cannot be set; build rows with make_batch_caches() "
            "and join them with extend()")

    def trim(self, n: int) -> int:
        """Forget the last ``n`` columns of every row; frees the blocks no row needs.

        Raises:
            PoolArgumentTypeError: ``n`` is not an integer.
            PoolArgumentError: ``n`` is negative.
        """
        n = min(self._idx, check_trim(n))
        self._idx -= n
        self.offset = self.offset - n
        for i, row in enumerate(self.rows):
            self._settle(row, self.real_tokens(i))
        return n

    def size(self) -> int:
        """Columns written (the longest row plus its padding)."""
        return self._idx

    def __len__(self) -> int:
        return len(self.rows)


def make_batch_caches(
    model,
    pool: BlockPoolAllocator,
    owners: int | Sequence[int],
    left_padding: Sequence[int] | None = None,
    step: int | None = None,
) -> list[PoolBackedBatchKVCache]:
    """One :class:`PoolBackedBatchKVCache` per layer of ``model``, one row per owner.

    Prefill requests into these (left-padded to a common length when several
    prefill together), then ``extend`` a running batch with them.

    Args:
        model: An mlx-lm model.
        pool: The shared pool.
        owners: The request id of each row (an int for a single row).
        left_padding: Padding columns in front of each row's prompt.
        step: Accounting growth chunk; defaults to ``pool.config.block_size``.

    Raises:
        ValueError: The model needs a cache other than a plain ``KVCache`` in some layer.
    """
    require_plain_kv_model(model, "PoolBackedBatchKVCache",
                           "this model cannot be batched on the pool")
    rows = [owners] if isinstance(owners, int) else list(owners)
    return [PoolBackedBatchKVCache(pool, rows, left_padding, step)
            for _ in range(len(model.layers))]
