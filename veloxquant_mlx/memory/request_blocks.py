"""One request's KV in the pool's block storage: what its layers' caches view.

:func:`~veloxquant_mlx.memory.pool_backed.build_pooled_caches` given a
``storage`` (the pool's :class:`~veloxquant_mlx.memory.kv_arena.KVArena`)
returns one :class:`~veloxquant_mlx.memory.pool_backed.PoolBackedKVCache`
per layer over ONE :class:`RequestBlocks`: the request's block table
(a :class:`~veloxquant_mlx.memory.paged_rows.PagedRow`, every layer's keys
and values) in that storage. The server batches requests by handing their
tables to a :class:`~veloxquant_mlx.memory.paged_batch.PagedKVBatch`; a
request used on its own (``mlx_lm.generate(..., prompt_cache=caches)``)
runs through a one-row batch of its own, made here on first use::

    request 7: caches[0..L-1] ──> RequestBlocks(owner 7) ──> PagedRow: block ids per layer/stream
                                        │                         │
                  alone: a one-row PagedKVBatch        served: rows of the engine's batches
                                        └──────── KVArena slots (the pool's storage) ──┘
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.exceptions import PoolArgumentError
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.memory.kv_arena import KVArena
from veloxquant_mlx.memory.paged_batch import PagedKVBatch
from veloxquant_mlx.memory.paged_rows import PagedRow, free


class RequestBlocks:
    """The blocks of one request, every layer, in one storage.

    Args:
        storage: The pool's block storage.
        owner: The request's id: every block is checked out to it.

    Raises:
        PoolArgumentError: ``storage`` is not a :class:`KVArena`.
    """

    __slots__ = ("storage", "row", "_alone")

    def __init__(self, storage: KVArena, owner: int) -> None:
        if not isinstance(storage, KVArena):
            raise PoolArgumentError(
                f"storage must be the pool's KVArena, got {type(storage).__name__}")
        self.storage = storage
        self.row = PagedRow.empty(owner, 0, 2 * storage.layout.n_layers)
        self._alone: PagedKVBatch | None = None

    @property
    def pool(self) -> BlockPoolAllocator:
        return self.storage.pool

    @property
    def tokens(self) -> int:
        """Tokens the request holds (in every layer)."""
        return self.row.tokens

    def offset(self, layer: int):
        """RoPE position of layer ``layer``'s next column.

        The request's token count, or while it runs alone its batch's
        positions (the first layer of a call has already counted its columns).
        """
        if self._alone is None:
            return self.row.tokens
        return self._alone.caches[layer].offset

    def alone(self) -> PagedKVBatch:
        """The one-row batch this request runs in when used outside a server batch.

        It attends with mlx-lm's own attention, so it returns what a stock
        ``KVCache`` does, bit for bit.
        """
        if self._alone is None:
            self._alone = PagedKVBatch(self.storage, [self.row], fast_attention=False)
        return self._alone

    def layer_kv(self, layer: int) -> tuple[mx.array, mx.array]:
        """Layer ``layer``'s stored keys and values, ``(1, H_kv, tokens, D)`` each."""
        if self._alone is not None:
            self._alone.flush()
        row, tokens = self.row, self.row.tokens
        if not tokens:
            return None, None
        ids = mx.array(row.ids[2 * layer: 2 * layer + 2, : row.n_blocks])
        heads = mx.arange(self.storage.layout.n_kv_heads)[None, :, None]
        both = self.storage.gather(self.storage.gather_index(heads, ids), 2,
                                   row.n_blocks * self.storage.block_size)
        both = both[:, :, :tokens]
        return both[:1], both[1:]

    def layer_bytes(self) -> int:
        """Storage bytes one layer's blocks take (keys and values)."""
        return 2 * self.row.n_blocks * self.storage.layout.bytes_per_block(
            self.storage.block_size)

    def close(self) -> None:
        """Give the request's own blocks back; its table is empty after."""
        if self._alone is not None:
            self._alone.close()
            self._alone = None
        else:
            free(self.pool, [self.row])
