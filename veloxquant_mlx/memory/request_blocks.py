"""One request's KV in the pool's block storage: what its layers' caches view.

:func:`~veloxquant_mlx.memory.pool_backed.build_pooled_caches` given a
``storage`` (the pool's :class:`~veloxquant_mlx.memory.kv_arena.KVArena`)
returns one :class:`~veloxquant_mlx.memory.pool_backed.PoolBackedKVCache`
per layer over ONE :class:`RequestBlocks`: the request's block table
(a :class:`~veloxquant_mlx.memory.paged_rows.PagedRow`, every layer's keys
and values) in that storage. The server batches requests by handing their
tables to a :class:`~veloxquant_mlx.memory.paged_batch.PagedKVBatch`; a
request used on its own (``mlx_lm.generate(..., prompt_cache=caches)``)
runs through a one-row batch of its own, made here on first use;
:func:`make_batch_caches` batches requests::

    request 7: caches[0..L-1] ──> RequestBlocks(owner 7) ──> PagedRow: block ids per layer/stream
                                        │                         │
                  alone: a one-row PagedKVBatch        served: rows of the engine's batches
                                        └──────── KVArena slots (the pool's storage) ──┘
"""

from __future__ import annotations

from collections.abc import Sequence

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
        """The pool the storage was laid out for."""
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

    def layer_kv(self, layer: int) -> tuple[mx.array | None, mx.array | None]:
        """Layer ``layer``'s stored keys and values, ``(1, H_kv, tokens, D)`` each (None, None
        while it holds no token)."""
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


def make_batch_caches(model, arena: KVArena, requests: int | Sequence[object],
                      left_padding: Sequence[int] | None = None,
                      fast_attention: bool = True) -> PagedKVBatch:
    """A :class:`PagedKVBatch` for ``model``; pass ``batch.caches`` as its cache.

    ``requests``: per row, the request's caches from
    ``build_pooled_caches(model, pool, owner, storage=arena)`` (the batch reads and
    grows their block table), or an owner id for a row of the batch's own.

    With ``fast_attention`` (see :class:`PagedKVBatch`), a model of
    :mod:`veloxquant_mlx.llama_model` attends through
    :mod:`~veloxquant_mlx.memory.paged_attention` on these caches (a faster
    softmax on the CPU); other models run mlx-lm's attention.

    Raises:
        ValueError: The model's layer count is not the arena's.
    """
    if len(model.layers) != arena.layout.n_layers:
        raise ValueError(f"model has {len(model.layers)} layers, the arena was laid out "
                         f"for {arena.layout.n_layers}")
    # Only a model whose attention reads the batch's parts (the project's Llama-shaped
    # one) gets them: kept unread they would pin the arena version they came from.
    reads_parts = bool(getattr(model, "reads_paged_parts", False))
    rows = [requests] if isinstance(requests, int) else [
        r if isinstance(r, int) else _blocks_of(r, arena).row for r in requests]
    return PagedKVBatch(arena, rows, left_padding, fast_attention and reads_parts)


def _blocks_of(caches: Sequence[object], arena: KVArena) -> RequestBlocks:
    """The :class:`RequestBlocks` under one request's caches, checked against ``arena``.

    Raises:
        ValueError: The caches are not a request's caches over ``arena``.
    """
    blocks = getattr(caches[0], "blocks", None) if len(caches) else None
    if not isinstance(blocks, RequestBlocks) or blocks.storage is not arena:
        raise ValueError("a batch row must be an owner id or the caches of "
                         "build_pooled_caches(model, pool, owner, storage=arena) of this arena")
    return blocks
