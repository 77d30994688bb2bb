"""PooledKVCache: block-pool accounting around any VeloxQuant ``KVCache``.

The wrapped cache keeps compressing and storing its own arrays; this wrapper
checks blocks out of a shared :class:`BlockPoolAllocator` in step with the
appends, so one pool sees every live cache's allocation, reuse and
fragmentation. Keys draw from stream ``"k"``, values from ``"v"``.

Block granularity (block_size B = 4, one stream)::

    append 3 tokens   -> allocate 1 block            [xxx.]
    append 1 token    -> no allocation, n_used 3->4  [xxxx]
    append 6 tokens   -> allocate 2 blocks           [xxxx][xxxx][xx..]

A new block is requested only when the last one is full; a multi-token
append takes all the blocks it needs in one ``allocate`` call. ``release()``
returns every block at once when the request ends.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from veloxquant_mlx.cache.base import KVCache
from veloxquant_mlx.exceptions import CacheReleasedError, PoolArgumentTypeError
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.memory.leases import require_owned
from veloxquant_mlx.memory.records import Block


class PooledKVCache(KVCache):
    """A ``KVCache`` whose token slots are accounted in a shared block pool.

    Invariants: for each stream, the blocks held cover exactly the rows the
    inner cache stores (all blocks but the last are full, the last holds the
    remainder), and ``sum(block.n_used)`` equals ``inner.n_keys`` (stream
    "k") or ``inner.n_values`` (stream "v").

    Args:
        inner: The cache that does the compression and stores the data.
        pool: The shared pool.
        owner: Id unique to this cache among the pool's live owners; it is
            registered on construction, so a collision raises at once.
        format: Tag recorded on every block; defaults to ``inner.format``.

    Raises:
        OwnerAlreadyActiveError: ``owner`` is already active on ``pool``.
    """

    def __init__(
        self, inner: KVCache, pool: BlockPoolAllocator, owner: int, format: str | None = None
    ) -> None:
        if not isinstance(inner, KVCache):
            raise TypeError(
                f"inner must be a veloxquant_mlx KVCache, got {type(inner).__name__}; "
                "build one with KVCacheBuilder"
            )
        if not isinstance(pool, BlockPoolAllocator):
            raise PoolArgumentTypeError(
                f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
        super().__init__(inner.config)
        self.inner = inner
        self.pool = pool
        self.owner = owner
        self._format = inner.format if format is None else format
        self._blocks: dict[str, list[Block]] = {"k": [], "v": []}
        self._released = False
        pool.register_owner(owner)

    @property
    def format(self) -> str:
        return self._format

    @property
    def n_keys(self) -> int:
        return self.inner.n_keys

    @property
    def n_values(self) -> int:
        return self.inner.n_values

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def decode_keys(self) -> mx.array:
        return self.inner.decode_keys()

    def decode_values(self) -> mx.array:
        return self.inner.decode_values()

    def key_scores(self, queries: mx.array) -> mx.array:
        return self.inner.key_scores(queries)

    def combine_values(self, probs: mx.array) -> mx.array:
        return self.inner.combine_values(probs)

    def blocks(self, stream: str) -> list[Block]:
        """Blocks held for ``stream`` ("k" or "v"), in allocation order (a copy)."""
        return list(self._blocks[stream])

    def n_blocks_held(self) -> int:
        """Total K + V blocks currently checked out by this cache."""
        return len(self._blocks["k"]) + len(self._blocks["v"])

    def release(self) -> None:
        """Return every block to the pool (``pool.free_all(owner)``); idempotent.

        The compressed data stays readable (``attend`` still works), but the
        cache accepts no more appends: a new request needs a new cache.
        """
        if not self._released:
            self.pool.free_all(self.owner)
            self._blocks = {"k": [], "v": []}
            self._released = True

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has been called."""
        return self._released

    def append(self, k: object, v: object) -> None:
        """Keys and values of the same tokens, all-or-nothing: the blocks of both
        streams are checked out before either is stored."""
        keys, values = self._paired_rows(k, v)

        def write() -> None:
            self.inner.append_key(keys)
            self.inner.append_value(values)

        self._account({"k": keys.shape[0], "v": values.shape[0]}, write)

    def _append_keys(self, keys: mx.array) -> None:
        self._account({"k": keys.shape[0]}, lambda: self.inner.append_key(keys))

    def _append_values(self, values: mx.array) -> None:
        self._account({"v": values.shape[0]}, lambda: self.inner.append_value(values))

    def _account(self, tokens: dict[str, int], write: Callable[[], None]) -> None:
        """Fill each stream's last block, allocate the overflow, then let ``write`` store.

        Every stream's allocation happens before the write, so that an
        exhausted pool leaves the inner cache untouched (the pool is
        all-or-nothing too).
        """
        if self._released:
            raise CacheReleasedError(
                f"PooledKVCache for owner {self.owner} was released; its blocks are back in "
                "the pool. Build a new cache (new owner id) for the next request"
            )
        bs = self.pool.config.block_size
        plans = []  # (held, last block, rows filled in it, new blocks) per stream
        try:
            for stream, n_tokens in tokens.items():
                held = self._blocks[stream]
                require_owned(held[-1:], self.owner)
                last = held[-1] if held else None
                fill = min(bs - last.n_used if last is not None else 0, n_tokens)
                plans.append((held, last, fill, []))
                if n_tokens > fill:
                    plans[-1][3].extend(self.pool.allocate(stream, n_tokens - fill, self.owner,
                                                           format=self._format))
            write()
        except BaseException:
            self._give_back([block for plan in plans for block in plan[3]])
            raise
        for held, last, fill, new in plans:
            if fill:
                last.n_used = last.n_used + fill
            held.extend(new)

    def _give_back(self, new: list[Block]) -> None:
        """Free blocks a failed append took, keeping this cache's claim on its owner id."""
        if new:
            self.pool.free(new)
            # Freeing an owner's last blocks deactivates it; keep our claim.
            if self.owner not in self.pool.active_owners():
                self.pool.register_owner(self.owner)
