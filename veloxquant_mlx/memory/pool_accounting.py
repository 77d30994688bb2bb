"""The pool side of :class:`~veloxquant_mlx.memory.pool_backed.PoolBackedKVCache`.

:class:`PoolAccountedCache` is a layer cache's fields and its bookkeeping in the pool: it
attaches to a pool under the request's owner lease, holds blocks for exactly the tokens it
keeps (growing a ``step`` at a time, freeing whole blocks past a trim), and gives them back
once for all the layers of a request. ``PoolBackedKVCache`` speaks mlx-lm's cache protocol
on top of it. They are apart so that the accounting every write, trim and state load goes
through reads as one short class, not spread between the protocol's methods.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.exceptions import (
    CacheReleasedError,
    PoolArgumentTypeError,
    VeloxQuantError,
)
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator
from veloxquant_mlx.memory.leases import (
    LayerGroup,
    OwnerLease,
    lease_for,
    release_lease,
    require_owned,
)
from veloxquant_mlx.memory.pool_config import check_count
from veloxquant_mlx.memory.pool_kv_common import (
    DEFAULT_BUFFER_STEP,
    ContiguousKVBuffer,
    allocate_kv,
    check_positive,
    format_of,
    free_past,
    mark_used,
    tokens_to_grow,
)
from veloxquant_mlx.memory.request_blocks import RequestBlocks


class PoolAccountedCache(ContiguousKVBuffer):
    """A layer cache's fields and the blocks it holds for them in a pool.

    The keys and values are :class:`ContiguousKVBuffer`'s buffers, or in the paged form
    the request's :class:`RequestBlocks`. A subclass provides ``offset`` (the tokens
    kept), writes the keys and values, and calls :meth:`_account` whenever the tokens it
    keeps change.
    """

    def _detach(self) -> None:
        """Set the fields of an empty cache with no pool."""
        self.keys = None
        self.values = None
        self.offset = 0
        self.pool: BlockPoolAllocator | None = None
        self.owner: int | None = None
        self.step: int | None = None
        self.buffer_step = DEFAULT_BUFFER_STEP
        self._lease: OwnerLease | None = None
        self._layers: LayerGroup | None = None  # set by build_pooled_caches
        self._k_blocks: list[Block] = []
        self._v_blocks: list[Block] = []
        self._block_size = 0
        # The paged form: the request's blocks in the pool's storage, and this layer.
        self.blocks: RequestBlocks | None = None
        self.layer = 0

    def attach(self, pool: BlockPoolAllocator, owner: int, step: int | None = None) -> None:
        """Bind a detached cache (e.g. one from ``load_prompt_cache``) to a pool.

        Blocks for the tokens already in the cache are allocated at once.

        Args:
            pool: Pool to account in.
            owner: Request id; caches sharing it share one lease.
            step: Accounting growth chunk; defaults to ``pool.config.block_size``.

        Raises:
            VeloxQuantError: If the cache is already attached.
            PoolArgumentTypeError: If ``pool`` is not a ``BlockPoolAllocator``
                or ``owner`` is not an int.
            BlockPoolExhaustedError: If the pool cannot cover the cache's tokens.
        """
        if self.pool is not None:
            raise VeloxQuantError("this PoolBackedKVCache is already attached to a pool; "
                                  "build a new cache for another request")
        if not isinstance(pool, BlockPoolAllocator):
            raise PoolArgumentTypeError(
                f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
        check_count("owner", owner, -(2**63))  # now, not at the first update
        self.step = check_positive("step", step if step is not None else pool.config.block_size)
        self.pool = pool
        self.owner = owner
        self._block_size = pool.config.block_size
        self._lease = lease_for(pool, owner)
        try:
            self._account(self.offset, self._dtype())
        except BaseException:
            # Stay detached so the caller can attach to a roomier pool.
            self.pool = self.owner = self.step = self._lease = None
            raise

    def _require_live(self) -> None:
        if self._lease is None:
            raise VeloxQuantError(
                "PoolBackedKVCache is not attached to a pool (it was loaded from a file?); "
                "call cache.attach(pool, owner) or use load_pooled_prompt_cache()")
        if self._lease.released:
            raise CacheReleasedError(
                f"the caches of owner {self.owner} were released; build new caches with "
                "build_pooled_caches() for a new request"
            )

    def _dtype(self) -> mx.Dtype:
        """The dtype new blocks are tagged with (float16 while empty)."""
        return self.keys.dtype if self.keys is not None else mx.float16

    def _account(self, end: int, dtype: mx.Dtype) -> None:
        """Hold blocks for exactly the tokens ``[0, end)`` plus growth slack.

        Allocates in ``step`` chunks when ``end`` passes the held tokens and
        frees whole blocks past ``end`` (after a trim). Raises before changing
        anything if the pool is exhausted or took the blocks back.
        """
        bs = self._block_size
        require_owned(self._k_blocks, self.owner)
        require_owned(self._v_blocks, self.owner)
        if end > len(self._k_blocks) * bs:
            self._grow_to(end, dtype)
        else:
            free_past(self.pool, self._k_blocks, self._v_blocks, -(-end // bs))
        mark_used(self._k_blocks, self._v_blocks, 0, end, bs)

    def _grow_to(self, end: int, dtype: mx.Dtype) -> None:
        """Allocate whole ``step`` chunks until the held blocks cover ``end`` tokens."""
        held = len(self._k_blocks) * self._block_size
        k_new, v_new = allocate_kv(self.pool, self.owner, tokens_to_grow(end, held, self.step),
                                   format_of(dtype))
        self._k_blocks.extend(k_new)
        self._v_blocks.extend(v_new)

    def release(self) -> None:
        """Return every block of this cache's owner to the pool.

        Frees the blocks of all layers sharing the owner, once; later calls
        (on this or any sibling layer) are no-ops. A detached cache has
        nothing to release.
        """
        if self._lease is not None and not self._lease.released and self.blocks is not None:
            self.blocks.close()  # the table lets go of its blocks; the lease frees them
        if self._lease is not None:
            release_lease(self._lease)

    @property
    def released(self) -> bool:
        """Whether this cache's owner lease has been released."""
        return self._lease is not None and self._lease.released

    def n_blocks_held(self) -> int:
        """K plus V blocks this layer holds (0 once released)."""
        if self.released:
            return 0
        if self.blocks is not None:
            return 2 * self.blocks.row.n_blocks
        return len(self._k_blocks) + len(self._v_blocks)
