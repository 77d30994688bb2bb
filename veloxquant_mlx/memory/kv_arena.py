"""The KV arena: the block pool's blocks as one preallocated MLX array.

Every block id the pool hands out (``"k"`` and ``"v"`` streams share one id
space) names one slot range of the arena, so the memory a request's KV uses
is exactly the blocks it holds, whatever the mix of lengths in a batch::

    arena  (H_kv, (n_ids + 1) * block_size, D)       one array for every layer
             block id b -> slots [b * block_size, (b + 1) * block_size)
             id n_ids   -> the trash block (padding columns are written there)

    coded formats (q8, q4, turboquant_mse, polar; see kv_format.py) keep two
    arrays of the same slots:
    codes  (H_kv, slots, code_width) uint8       params (H_kv, slots, param_width) float16

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
from veloxquant_mlx.memory.kv_format import NATIVE, KVFormat
from veloxquant_mlx.memory.write_back import held_bytes


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token of one layer's keys (or values) looks like.

    Attributes:
        n_layers: Layers with a KV cache.
        n_kv_heads: KV heads per layer.
        head_dim: Dimension of each head (keys and values alike).
        dtype: The dtype keys and values are computed in.
        kv_format: How blocks store them (the compute dtype, or codes).
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    kv_format: KVFormat = NATIVE

    @property
    def format_tag(self) -> str:
        """The blocks' ``format`` tag (``"fp32"``, ``"q8g64"``, ...)."""
        return self.kv_format.tag(self.dtype)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one pool block stores (one layer, k or v, all KV heads, in the format)."""
        return block_size * self.n_kv_heads * self.kv_format.vector_bytes(self.head_dim,
                                                                          self.dtype)

    def dense_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block's keys (or values) once decoded to the compute dtype."""
        return block_size * self.n_kv_heads * self.head_dim * self.dtype.size

    def bytes_per_token(self) -> int:
        """KV bytes of one token over every layer, keys and values (as stored)."""
        return 2 * self.n_layers * self.bytes_per_block(1)


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


def probe_kv_layout(model: Any, kv_format: KVFormat = NATIVE) -> KVLayout:
    """Run one token through ``model`` to learn its KV heads, head_dim and dtype.

    Args:
        model: An mlx-lm model.
        kv_format: How the arena will store keys and values.

    Raises:
        ValueError: Layers differ in shape or dtype, or keys and values
            differ in head_dim (the arena stores both in one array).
        KVFormatError: ``kv_format``'s groups do not divide the head_dim.
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
    kv_format.check(k_dim)
    return KVLayout(len(model.layers), heads, k_dim, dtype, kv_format)


def workspace_bytes(layout: KVLayout, block_size: int, max_rows: int, max_tokens: int,
                    write_back: int = 1) -> int:
    """Transient KV bytes of one model call, at most (fixed; counted apart from blocks).

    One layer's keys and values gathered for ``max_rows`` rows padded to the
    longest, ``ceil(max_tokens / block_size)`` blocks each, and the copy that
    appends the call's own columns to them (so twice that), plus the trash
    block. Layers run one after another, so one layer's gather is live at a
    time. A coded format gathers its codes and params, then decodes them
    (q8/q4: a cast, a multiply, an add; turboquant_mse and polar: a table
    lookup, a scale, a rotation; up to three decoded copies alive at once,
    as tests/e2e/test_kv_formats.py measures) before the append, so it counts
    the gathered blocks as stored plus three decoded copies. A decode batch
    that holds ``write_back`` columns out of the arena adds those and the
    copies that write them (:func:`held_bytes`).
    """
    gathered = 2 * max_rows * -(-max_tokens // block_size)  # blocks, keys and values
    stored, dense = layout.bytes_per_block(block_size), layout.dense_bytes_per_block(block_size)
    held = held_bytes(layout.n_layers, layout.n_kv_heads, layout.head_dim, layout.dtype,
                      max_rows, write_back)
    if not layout.kv_format.quantized:
        return (2 * gathered + 1) * stored + held
    return gathered * (stored + 3 * dense) + stored + held


class KVArena:
    """One preallocated array holding every pool block's keys or values.

    Args:
        pool: The shared pool (its ids, present and grown, index the arena).
        layout: The model's KV layout (:func:`probe_kv_layout`).

    Attributes:
        data: ``(H_kv, (n_ids + 1) * block_size, D)`` in the compute dtype, or
            for a quantized format the pair ``(codes, params)`` (module
            docstring); replaced (not copied) by every write, so read it
            afresh each time. ``mx.eval(arena.data)`` works for both.
        trash: The block id padding columns are written to.
    """

    def __init__(self, pool: BlockPoolAllocator, layout: KVLayout) -> None:
        self.pool = pool
        self.layout = layout
        self.block_size = pool.config.block_size
        self.n_ids = 0
        self.data: mx.array | None = None
        # Scatters into the arena so far: on a GPU each one copies all of it (see
        # veloxquant_mlx/memory/write_back.py), so /metrics reports them.
        self.writes = 0
        self._views: tuple[mx.array, ...] = ()  # built by _block_views, dropped by writes
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
        slots = (ids + 1 - self.n_ids) * self.block_size
        self._views = ()  # they would keep the old arena alive
        fresh = [mx.zeros((self.layout.n_kv_heads, slots, width), dtype)
                 for width, dtype in self._columns()]
        kept = self.n_ids * self.block_size
        if self.data is not None:
            old = self.data if self.quantized else (self.data,)
            fresh = [mx.concatenate([o[:, :kept], f], axis=1)
                     for o, f in zip(old, fresh, strict=True)]
        self.data = tuple(fresh) if self.quantized else fresh[0]
        self.n_ids = ids
        mx.eval(self.data)
        return True

    @property
    def quantized(self) -> bool:
        """Whether blocks hold codes (``data`` is then ``(codes, params)``)."""
        return self.layout.kv_format.quantized

    @property
    def format_tag(self) -> str:
        """The ``format`` tag every block of this arena carries (``"fp32"``, ``"q8g64"``)."""
        return self.layout.format_tag

    def _columns(self) -> list[tuple[int, mx.Dtype]]:
        """Width and dtype of each storage array, per head and slot."""
        lay, fmt = self.layout, self.layout.kv_format
        if not fmt.quantized:
            return [(lay.head_dim, lay.dtype)]
        return [(fmt.code_width(lay.head_dim), mx.uint8),
                (fmt.param_width(lay.head_dim), mx.float16)]

    @staticmethod
    def gather_index(heads: mx.array, table: mx.array) -> tuple[mx.array, mx.array]:
        """The index of :meth:`gather` for ``table``'s block ids, broadcast once.

        Args:
            heads: ``arange(H_kv)[None, :, None]``.
            table: Block ids (``rows, blocks``), one row of ids per output row.

        A caller keeps it while its table stands (a decode batch: up to its
        write-back's 32 steps), so each step's gathers add no broadcast nodes.
        """
        return tuple(mx.broadcast_arrays(heads, table[:, None, :]))

    def gather(self, index: tuple[mx.array, mx.array], rows: int, width: int) -> mx.array:
        """The blocks of a table as ``(rows, H_kv, width, D)`` values.

        Args:
            index: :meth:`gather_index` of the table.
            rows: Output rows (the table's first dimension).
            width: ``blocks x block_size`` columns per row.
        """
        takes = [blocks[index].reshape(rows, blocks.shape[0], width, -1)
                 for blocks in self._block_views()]
        if not self.quantized:
            return takes[0]
        return self.layout.kv_format.decode(*takes, self.layout.dtype, self.layout.head_dim)

    def _block_views(self) -> tuple[mx.array, ...]:
        """Each storage array as ``(H_kv, ids + 1, block_size, -1)``, one view per write.

        Every layer of a step gathers from the same views (a reshape node per
        layer and step otherwise); :meth:`store` and a growth drop them.
        """
        if not self._views:
            arrays = self.data if self.quantized else (self.data,)
            self._views = tuple(a.reshape(a.shape[0], self.n_ids + 1, self.block_size, -1)
                                for a in arrays)
        return self._views

    def store(self, heads: mx.array, slots: mx.array, values: mx.array) -> None:
        """Write ``values`` (``H_kv, n, D``) into ``slots`` (``1, n``), encoding if quantized.

        Args:
            heads: ``arange(H_kv)[:, None]``.
            slots: Arena slot of each column (block id x block_size + offset).
            values: The keys or values to store, in the compute dtype.
        """
        self.writes += 1
        # Drop the cached views first: a view still holding the buffer would make
        # the scatter copy the whole arena instead of writing it in place.
        self._views = ()
        if not self.quantized:
            self.data[heads, slots] = values
            return
        for array, part in zip(self.data, self.layout.kv_format.encode(values), strict=True):
            array[heads, slots] = part
