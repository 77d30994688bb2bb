"""MLX buffers behind a block pool's blocks.

:class:`MLXBlockStorage` pairs with a :class:`~veloxquant_mlx.memory.BlockPoolAllocator`:
the pool decides *which* block a request gets, the storage holds *what is in
it* as one ``mx.array`` per block id, shaped ``(block_size, head_dim)``.

Storage dtype per format tag (the tag is the ``format`` passed to
``pool.allocate``):

=========  ============  =====================================================
format     dtype         meaning
=========  ============  =====================================================
fp32       float32       full precision
fp16       float16       half precision (the pool's default tag)
bf16       bfloat16      brain float
int8       int8          signed 8-bit codes
uint8      uint8         unsigned 8-bit codes
int4       uint8         4-bit codes, one per element (packing is the
                         writer's business: it may write packed bytes with a
                         narrower ``head_dim`` storage)
int2       uint8         2-bit codes, one per element
int1       uint8         1-bit codes, one per element
uint32     uint32        packed words (as ``mx.quantize`` produces)
=========  ============  =====================================================

Blocks are reused in place: a recycled block keeps its buffer and a write
overwrites the old rows. The first time the storage sees a block in a new
checkout (``block.checkouts`` moved on: the pool handed it out again), it
zeroes the buffer in place, so :meth:`MLXBlockStorage.read` (the block's
``block.n_used`` rows) never shows a previous owner's rows, even though
``allocate()`` marks the rows as used before anything is written. A buffer is
re-made only when the block's format tag changes.

Not thread-safe: one generation thread owns the storage, as it owns the model.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.exceptions import ForeignBlockError, PoolArgumentTypeError
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator

FORMAT_DTYPES: dict[str, mx.Dtype] = {
    "fp32": mx.float32,
    "fp16": mx.float16,
    "bf16": mx.bfloat16,
    "int8": mx.int8,
    "uint8": mx.uint8,
    "int4": mx.uint8,
    "int2": mx.uint8,
    "int1": mx.uint8,
    "uint32": mx.uint32,
}
"""Format tag -> storage dtype. The module docstring explains each row."""


def dtype_for(format: str) -> mx.Dtype:
    """The storage dtype of a format tag.

    Args:
        format: A block's format tag.

    Returns:
        The ``mx.Dtype`` its buffer uses.

    Raises:
        ValueError: For a tag not in :data:`FORMAT_DTYPES`.
    """
    try:
        return FORMAT_DTYPES[format]
    except KeyError:
        raise ValueError(
            f"no storage dtype for block format {format!r}; use one of "
            f"{sorted(FORMAT_DTYPES)} when allocating, or add it to FORMAT_DTYPES"
        ) from None


class MLXBlockStorage:
    """One lazily created ``mx.array`` buffer per block id of a pool.

    Invariants:
        * a buffer exists only for block ids that were written or read;
        * a buffer's dtype is ``dtype_for(format)`` of the format it was made
          for, and it is re-made only when the block's format tag changes;
        * after ``write(block, offset, values)`` of n >= 1 rows,
          ``block.n_used >= offset + n``;
        * ``read`` never returns rows written under an earlier checkout of the block.

    Args:
        pool: The pool whose blocks this storage backs.
        head_dim: Width of one token slot (columns of every buffer).

    Raises:
        PoolArgumentTypeError: If ``pool`` is not a ``BlockPoolAllocator``.
        ValueError: If ``head_dim < 1``.
    """

    def __init__(self, pool: BlockPoolAllocator, head_dim: int) -> None:
        if not isinstance(pool, BlockPoolAllocator):
            raise PoolArgumentTypeError(
                f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        self.pool = pool
        self.head_dim = head_dim
        self.block_size = pool.config.block_size
        self._buffers: dict[int, mx.array] = {}
        self._formats: dict[int, str] = {}
        self._checkouts: dict[int, int] = {}  # block id -> checkout its rows belong to

    def _buffer(self, block: Block) -> mx.array:
        """The block's buffer, made (or re-made on a format change) if needed.

        A block handed out again since the storage last saw it has its old
        rows zeroed in place: ``allocate()`` marks them used, and they belong
        to the previous owner.
        """
        key = block.block_id
        buffer = self._buffers.get(key)
        if buffer is None or self._formats[key] != block.format:
            buffer = mx.zeros((self.block_size, self.head_dim), dtype=dtype_for(block.format))
            self._buffers[key] = buffer
            self._formats[key] = block.format
        elif self._checkouts[key] != block.checkouts:
            buffer[:] = 0
        self._checkouts[key] = block.checkouts
        return buffer

    def _require_ours(self, block: Block, verb: str) -> None:
        if not isinstance(block, Block) or block._pool is not self.pool:
            # Buffers are keyed by id: another pool's block would reach (and, handed
            # out a different number of times, zero) our block of the same id.
            raise ForeignBlockError(
                f"{block!r} is not a block of this storage's pool (or was retired); "
                f"{verb} each pool's blocks through that pool's storage")

    def write(self, block: Block, offset: int, values: mx.array) -> None:
        """Write token rows into a block, starting at slot ``offset``.

        Args:
            block: A block currently checked out from the pool.
            offset: First token slot to write (0-based).
            values: Array of shape ``(n, head_dim)`` and the block format's dtype.

        Raises:
            ForeignBlockError: If ``block`` is not one of this pool's blocks.
            PoolArgumentTypeError: If ``offset`` is not an int.
            TypeError: If ``values`` is not an ``mx.array``.
            ValueError: If the block is free, the shape or dtype is wrong, or
                ``offset + n`` passes ``block_size``.
        """
        self._require_ours(block, "write")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise PoolArgumentTypeError(f"offset must be an int, got {type(offset).__name__}")
        if block.owner is None:
            raise ValueError(
                f"block {block.block_id} is free; allocate it from the pool before writing"
            )
        if not isinstance(values, mx.array):
            raise TypeError(f"values must be an mx.array, got {type(values).__name__}")
        expected = dtype_for(block.format)
        if values.ndim != 2 or values.shape[1] != self.head_dim:
            raise ValueError(
                f"values must have shape (n, {self.head_dim}), got {tuple(values.shape)}"
            )
        if values.dtype != expected:
            raise ValueError(
                f"block {block.block_id} has format {block.format!r}, which stores "
                f"{expected}; got {values.dtype} (cast with values.astype({expected}))"
            )
        n = values.shape[0]
        if offset < 0 or offset + n > self.block_size:
            raise ValueError(
                f"writing {n} row(s) at offset {offset} overflows block_size "
                f"{self.block_size}; split the write across blocks"
            )
        buffer = self._buffer(block)
        # Slice assignment updates the same array object: no new buffer per write.
        buffer[offset : offset + n] = values
        # A 0-row write stores nothing, so it claims no rows either.
        if n and offset + n > block.n_used:
            block.n_used = offset + n

    def read(self, block: Block) -> mx.array:
        """The live rows of a block.

        Args:
            block: Any block of the pool (a free one has no live rows).

        Returns:
            Array of shape ``(block.n_used, head_dim)``; rows the current owner
            has not written are zeros.

        Raises:
            ForeignBlockError: If ``block`` is not one of this pool's blocks.
        """
        self._require_ours(block, "read")
        return self._buffer(block)[: block.n_used]

    def resident_bytes(self) -> int:
        """Bytes held by materialised buffers (not the pool's whole capacity)."""
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def n_resident(self) -> int:
        """How many block ids currently have a buffer."""
        return len(self._buffers)

    def release(self, block: Block) -> None:
        """Drop a free (or retired) block's buffer so MLX can reclaim it now.

        Releasing a block that has no buffer is a no-op.

        Raises:
            ValueError: If the block is still checked out (its data is live).
        """
        if block.owner is not None:
            raise ValueError(
                f"block {block.block_id} is still owned by {block.owner!r}; "
                "free it on the pool before releasing its buffer"
            )
        self._buffers.pop(block.block_id, None)
        self._formats.pop(block.block_id, None)
        self._checkouts.pop(block.block_id, None)
