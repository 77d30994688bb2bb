"""The KV arena: the block pool's blocks as one preallocated MLX array.

Every block id the pool hands out (``"k"`` and ``"v"`` streams share one id
space) names one slot range of the arena, so the memory a request's KV uses
is exactly the blocks it holds, whatever the mix of lengths in a batch::

    arena  (H_kv, (n_ids + 1) * block_size, D)       one array for every layer
             block id b -> slots [b * block_size, (b + 1) * block_size)
             id n_ids   -> the trash block (padding columns are written there)

A pool block keeps its meaning of the single-request cache: ``block_size``
tokens of ONE layer's keys, or of one layer's values, for all KV heads. A
request holds ``ceil(tokens / block_size)`` blocks per layer and stream, in
any slots; attention gathers each layer's rows into a transient buffer (see
:mod:`veloxquant_mlx.memory.paged_batch`), bounded by :func:`workspace_bytes`.

The arena is allocated (and evaluated) once; it grows only when the pool
itself grows (``grow_on_exhaustion``), by whole blocks. Retired blocks
(``shrink``) keep their slots: shrinking lowers admission, not the arena.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token of one layer's keys (or values) looks like.

    Attributes:
        n_layers: Layers with a KV cache.
        n_kv_heads: KV heads per layer.
        head_dim: Dimension of each head (keys and values alike).
        dtype: The dtype keys and values are computed in.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one pool block stands for (one layer, k or v, all KV heads)."""
        return block_size * self.n_kv_heads * self.head_dim * self.dtype.size

    def bytes_per_token(self) -> int:
        """KV bytes of one token over every layer, keys and values."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.size


class _Probe:
    """A throw-away cache that records the shape and dtype of what it is given."""

    offset = 0

    def __init__(self) -> None:
        self.seen: tuple[int, int, int, mx.Dtype] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.seen = (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        return keys, values

    def make_mask(self, N: int, **kwargs):
        return None if N == 1 else "causal"


def probe_kv_layout(model: Any) -> KVLayout:
    """Run one token through ``model`` to learn its KV heads, head_dim and dtype.

    Raises:
        ValueError: Layers differ in shape or dtype, or keys and values
            differ in head_dim (the arena stores both in one array).
    """
    probes = [_Probe() for _ in model.layers]
    mx.eval(model(mx.array([[0]]), cache=probes))
    seen = {p.seen for p in probes}
    if len(seen) != 1 or None in seen:
        raise ValueError(f"layers disagree on their KV layout ({seen}); the KV arena "
                         "needs one shape and dtype for every layer")
    heads, k_dim, v_dim, dtype = seen.pop()
    if k_dim != v_dim:
        raise ValueError(f"keys ({k_dim}) and values ({v_dim}) differ in head_dim; the "
                         "KV arena stores both in one array")
    return KVLayout(len(model.layers), heads, k_dim, dtype)


def workspace_bytes(layout: KVLayout, block_size: int, max_rows: int, max_tokens: int) -> int:
    """Transient KV bytes of one model call, at most (fixed; counted apart from blocks).

    One layer's keys and values gathered for ``max_rows`` rows padded to the
    longest, ``ceil(max_tokens / block_size)`` blocks each, and the copy that
    appends the call's own columns to them (so twice that), plus the trash
    block. Layers run one after another, so one layer's gather is live at a
    time.
    """
    blocks = -(-max_tokens // block_size)
    return (2 * 2 * max_rows * blocks + 1) * layout.bytes_per_block(block_size)


class KVArena:
    """One preallocated array holding every pool block's keys or values.

    Args:
        pool: The shared pool (its ids, present and grown, index the arena).
        layout: The model's KV layout (:func:`probe_kv_layout`).

    Attributes:
        data: ``(H_kv, (n_ids + 1) * block_size, D)``; replaced (not copied)
            by every write, so read it afresh each time.
        trash: The block id padding columns are written to.
    """

    def __init__(self, pool: BlockPoolAllocator, layout: KVLayout) -> None:
        self.pool = pool
        self.layout = layout
        self.block_size = pool.config.block_size
        self.n_ids = 0
        self.data: mx.array | None = None
        self.ensure_ids()

    @property
    def trash(self) -> int:
        """Block id of the trash block (just past the pool's ids)."""
        return self.n_ids

    @property
    def nbytes(self) -> int:
        """Bytes of the arena (every pool id, plus the trash block)."""
        return (self.n_ids + 1) * self.layout.bytes_per_block(self.block_size)

    def ensure_ids(self) -> bool:
        """Cover every id the pool ever made; True when the arena had to grow.

        Growing copies the arena once per pool growth (``grow_on_exhaustion``);
        the trash block moves to the new end.
        """
        stats = self.pool.stats
        ids = stats.n_blocks + stats.n_retired  # ids are never reused
        if ids <= self.n_ids and self.data is not None:
            return False
        lay, bs = self.layout, self.block_size
        fresh = mx.zeros((lay.n_kv_heads, (ids + 1 - self.n_ids) * bs, lay.head_dim),
                         lay.dtype)
        if self.data is None:
            self.data = fresh
        else:
            self.data = mx.concatenate([self.data[:, : self.n_ids * bs], fresh], axis=1)
        self.n_ids = ids
        mx.eval(self.data)
        return True
