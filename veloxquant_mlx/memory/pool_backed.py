"""A drop-in ``mlx_lm`` ``KVCache`` whose memory is checked out from a block pool.

:class:`PoolBackedKVCache` speaks mlx-lm's cache protocol (``update_and_fetch``,
``offset``, ``state``, ``trim``, ``make_mask``, ...), so it can be passed as
``prompt_cache`` to ``mlx_lm.generate``. It has two forms:

* Over the pool's block storage (``build_pooled_caches(..., storage=arena)``,
  what the server builds for every request), each layer's cache views the
  request's block table: keys and values live in pool blocks and nowhere else
  (:mod:`~veloxquant_mlx.memory.request_blocks`).
* Without a storage (the seed's form), keys and values stay in one contiguous
  buffer per layer, grown 256 tokens at a time like the stock cache's, and the
  pool accounts them: a lone sequence skips the gather of its blocks at every
  step (``benchmark_pool_backed_kvcache.py`` measures both)::

    tokens   0 ........ 15 | 16 ....... 31 | 32 .. 37 |          offset = 38
    blocks   [ k0 | v0 ]   | [ k1 | v1 ]   | [k2|v2]  |          n_used 16, 16, 6
    buffer   [======================================........................]

  Each time ``offset`` passes the tokens held, ``step`` more tokens' worth of
  blocks (default ``pool.config.block_size``) are allocated on the ``"k"`` and
  ``"v"`` streams, each block's ``n_used`` equal to its real tokens; ``trim``
  gives surplus blocks back.

The caches of one request share an *owner lease*: ``release()`` on any of them
frees the owner's blocks once; later calls are no-ops, even after the owner id
was reused. ``save_prompt_cache`` works as is, and importing this module
registers the class in ``mlx_lm.models.cache`` so ``load_prompt_cache`` finds
it; loaded caches are detached until :meth:`PoolBackedKVCache.attach` (or use
:func:`~veloxquant_mlx.memory.pooled_caches.load_pooled_prompt_cache`).

Attaching, the blocks' accounting and the release are the base class's,
:class:`~veloxquant_mlx.memory.pool_accounting.PoolAccountedCache`; this module is
the mlx-lm cache protocol over them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from veloxquant_mlx.exceptions import BlockPoolExhaustedError, VeloxQuantError
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.memory.leases import require_owned
from veloxquant_mlx.memory.pool_accounting import PoolAccountedCache
from veloxquant_mlx.memory.pool_kv_common import (
    DEFAULT_BUFFER_STEP,
    check_kv_input,
    check_positive,
    check_single_sequence,
    check_trim,
    free_past,
    mark_used,
)
from veloxquant_mlx.memory.request_blocks import RequestBlocks


class PoolBackedKVCache(PoolAccountedCache):
    """mlx-lm ``KVCache`` replacement that accounts its memory in a block pool.

    Returns bit-for-bit what the stock ``KVCache`` returns for the same calls.

    Invariants (while attached and not released):
        * ``len(k_blocks) == len(v_blocks)`` and they cover at least
          ``offset`` tokens: ``ceil(offset / block_size) <= len(k_blocks)``;
        * block ``i`` has ``n_used == clamp(offset - i * block_size, 0, block_size)``;
        * ``keys.shape[2] >= offset`` (the buffer holds every live token).

    Args:
        pool: Shared pool to account growth in.
        owner: Request id the blocks are checked out to; unique per
            concurrent request. Every layer of one request uses the same id.
        step: Tokens of block accounting added per growth step; defaults to
            ``pool.config.block_size``.
        buffer_step: Tokens the contiguous buffer grows by (default 256, as
            stock). Only affects speed and peak bytes, never the output.

    Raises:
        ValueError: If ``step`` or ``buffer_step`` is not a positive int.
    """

    def __init__(
        self,
        pool: BlockPoolAllocator,
        owner: int,
        step: int | None = None,
        *,
        buffer_step: int = DEFAULT_BUFFER_STEP,
    ) -> None:
        self._detach()
        self.buffer_step = check_positive("buffer_step", buffer_step)
        self.attach(pool, owner, step=step)

    @classmethod
    def over_storage(cls, blocks: RequestBlocks, layer: int,
                     step: int | None = None) -> PoolBackedKVCache:
        """Layer ``layer``'s cache over a request's blocks (see ``build_pooled_caches``)."""
        cache = cls(blocks.pool, blocks.row.owner, step)
        cache.blocks, cache.layer = blocks, layer
        return cache

    @property
    def offset(self):
        """Tokens before the next column: an int, or the paged form's batch positions."""
        if self.blocks is None:
            return self._offset
        return self.blocks.offset(self.layer)

    @offset.setter
    def offset(self, value) -> None:
        self._offset = value

    # -- mlx-lm cache protocol -------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``B, H, n, D``) and return all live ones.

        Raises:
            BlockPoolExhaustedError: The pool cannot cover the new tokens; the
                cache is left unchanged, and the earlier layers of its model (caches
                made together by ``build_pooled_caches`` or
                ``load_pooled_prompt_cache``) that already took these tokens in this
                step trim them off again, so all layers are where the step began.
            PoolArgumentTypeError: ``keys``/``values`` are not ``mx.array``s.
            PoolArgumentError: They are not 4-D with the same token count.
            VeloxQuantError: The cache is detached or was released, or its
                blocks were freed behind its back (``pool.free_all(owner)``).
        """
        lease = self._lease
        if lease is None or lease.released:
            self._require_live()
        check_kv_input(keys, values)
        if self.blocks is not None:  # all layers grow at the first, all-or-nothing
            check_single_sequence(keys)
            return self.blocks.alone().caches[self.layer].update_and_fetch(keys, values)
        prev = self.offset
        end = prev + keys.shape[2]
        bs = self._block_size
        k_blocks = self._k_blocks
        # Only the blocks from the current one on are changed below.
        require_owned(k_blocks, self.owner, prev // bs)
        require_owned(self._v_blocks, self.owner, prev // bs)
        held = len(k_blocks)
        if end > held * bs:
            try:
                self._grow_to(end, keys.dtype)
            except BlockPoolExhaustedError:
                # This layer is unchanged; the layers this step already ran are put
                # back too, so the request's caches agree and the step can be rerun.
                if self._layers is not None:
                    self._layers.undo_step(self, prev, end - prev)
                raise
        try:
            self._write_columns(prev, end, keys, values, self.buffer_step)
        except BaseException:
            free_past(self.pool, k_blocks, self._v_blocks, held)  # what this call took
            raise
        self.offset = end
        last = (end - 1) // bs
        if prev // bs == last and last + 1 == len(k_blocks):
            # Decode fast path: only the last held block changes.
            used = end - last * bs
            k_blocks[last].n_used = used
            self._v_blocks[last].n_used = used
        else:
            mark_used(k_blocks, self._v_blocks, prev // bs, end, bs)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The live keys and values, ``[..., :offset, :]`` of the buffers."""
        if self.offset == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        """``(keys, values, offset)`` with only the live rows (stale rows never leak)."""
        if self.blocks is not None:
            keys, values = self.blocks.layer_kv(self.layer)
            return keys, values, self.blocks.tokens
        if self.keys is None:
            return None, None, 0
        keys, values = self.keys_and_values()
        return keys, values, self.offset

    @state.setter
    def state(self, v) -> None:
        keys, values, offset = v
        offset = int(offset) if keys is not None else 0
        if self.blocks is not None:
            raise VeloxQuantError(
                "the state of a PoolBackedKVCache over the pool's storage is its blocks; "
                "load saved caches with load_pooled_prompt_cache() instead")
        if self._lease is not None:
            self._require_live()
            # Account first: an exhausted pool must leave the old state in place.
            self._account(offset, keys.dtype if keys is not None else mx.float16)
        self.keys, self.values = keys, values
        self.offset = offset

    @property
    def meta_state(self) -> tuple[str, str]:
        """``(step, buffer_step)`` as strings (mlx-lm's meta-state convention)."""
        return str(self.step or 0), str(self.buffer_step)

    @meta_state.setter
    def meta_state(self, v) -> None:
        step, buffer_step = (int(x) for x in v)
        buffer_step = check_positive("buffer_step", buffer_step)
        if self.pool is not None:  # attached: growth needs a real step ("0" means none)
            step = check_positive("step", step)
        self.step = step or None
        self.buffer_step = buffer_step

    @classmethod
    def from_state(cls, state, meta_state=None) -> PoolBackedKVCache:
        """Rebuild a *detached* cache from ``state`` (used by ``load_prompt_cache``).

        Call :meth:`attach` before generating with it.
        """
        obj = cls.__new__(cls)
        obj._detach()
        if meta_state is not None:
            obj.meta_state = meta_state
        obj.state = state
        return obj

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (at most ``offset``); frees surplus blocks.

        Returns:
            The number of tokens trimmed.

        Raises:
            PoolArgumentTypeError: ``n`` is not an integer.
            PoolArgumentError: ``n`` is negative.
        """
        n = min(self.size(), check_trim(n))
        if self.blocks is not None:
            return 0  # a request's blocks only grow (is_trimmable() is False)
        if n and self._lease is not None:
            self._require_live()
            self._account(self.offset - n, self._dtype())
        self.offset -= n
        return n

    def size(self) -> int:
        """Tokens in the cache."""
        return self._offset if self.blocks is None else self.blocks.tokens

    def is_trimmable(self) -> bool:
        """True for the contiguous form; the paged form's blocks only grow."""
        return self.blocks is None

    def empty(self) -> bool:
        """True until the first append."""
        return self.size() == 0 if self.blocks is not None else self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's keys and values: its blocks, or the buffers."""
        if self.blocks is not None:
            return self.blocks.layer_bytes()
        return super().nbytes

    def make_mask(self, *args, **kwargs):
        """The attention mask for the next ``N`` tokens, as the stock cache makes it."""
        if self.blocks is not None:
            return self.blocks.alone().caches[self.layer].make_mask(*args, **kwargs)
        return _mlx_cache.create_attention_mask(*args, offset=self.offset, **kwargs)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Raises VeloxQuantError: a quantized cache would leave the pool's accounting."""
        raise VeloxQuantError(
            "PoolBackedKVCache cannot be converted to mlx-lm's QuantizedKVCache "
            f"(group_size={group_size}, bits={bits}); generate without kv_bits, or use "
            "a VeloxQuant compression method for a compressed cache")

    @classmethod
    def merge(cls, caches):
        """Raises VeloxQuantError: batching on the pool is ``make_batch_caches``'s job."""
        raise VeloxQuantError(
            "PoolBackedKVCache does not merge into a batch (mlx-lm batch generation); "
            "for batched decoding on the pool, build each request's caches with "
            "build_pooled_caches(model, pool, owner, storage=arena) and batch them with "
            "veloxquant_mlx.memory.request_blocks.make_batch_caches()")


# load_prompt_cache() resolves saved class names in mlx_lm.models.cache's
# namespace only; registering there makes files with our caches loadable.
setattr(_mlx_cache, PoolBackedKVCache.__name__, PoolBackedKVCache)
