"""Pieces of the pool-backed mlx-lm caches: input checks, paired blocks, the buffer.

:class:`~veloxquant_mlx.memory.pool_backed.PoolBackedKVCache` accounts tokens
in the shared pool as paired ``"k"``/``"v"`` blocks (so do a paged batch's
rows, :mod:`~veloxquant_mlx.memory.paged_rows`); its contiguous form keeps
keys and values in one buffer (:class:`ContiguousKVBuffer`).
"""

from __future__ import annotations

import operator

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from veloxquant_mlx.exceptions import PoolArgumentError, PoolArgumentTypeError
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator

DEFAULT_BUFFER_STEP = 256
"""Buffer growth chunk in tokens; mlx-lm's stock ``KVCache.step``."""

_FORMAT_OF_DTYPE = {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}


def format_of(dtype: mx.Dtype) -> str:
    """The pool's block ``format`` tag for a key/value dtype (``"fp16"``, ...)."""
    return _FORMAT_OF_DTYPE.get(dtype, str(dtype))


def check_positive(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int (bools excluded).

    Raises:
        ValueError: Otherwise, naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_kv_input(keys: object, values: object) -> None:
    """Refuse ``update_and_fetch`` input that cannot be written, before anything changes.

    Raises:
        PoolArgumentTypeError: ``keys`` or ``values`` is not an ``mx.array``.
        PoolArgumentError: They are not ``(B, H, n, D)`` arrays of the same ``n``.
    """
    if type(keys) is not mx.array or type(values) is not mx.array:
        raise PoolArgumentTypeError(
            f"keys and values must be mx.arrays, got {type(keys).__name__} and "
            f"{type(values).__name__}; convert with mx.array(...)")
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[2] != values.shape[2]:
        raise PoolArgumentError(
            f"keys and values must be (B, n_kv_heads, n, head_dim) with the same n, got "
            f"{tuple(keys.shape)} and {tuple(values.shape)}")


def check_single_sequence(keys: mx.array) -> None:
    """Refuse a batch of sequences for one request's cache.

    Raises:
        PoolArgumentError: ``keys`` holds more than one sequence (``B > 1``).
    """
    if keys.shape[0] != 1:
        raise PoolArgumentError(
            f"a request's PoolBackedKVCache holds one sequence, got a batch of "
            f"{keys.shape[0]}; batch requests with make_batch_caches()")


def check_trim(n: object) -> int:
    """``trim``'s token count as an int (numpy ints included).

    Raises:
        PoolArgumentTypeError: ``n`` is not an integer (``2.5``, ``"1"``).
        PoolArgumentError: ``n`` is negative (trimming cannot add tokens).
    """
    try:
        count = operator.index(n)
    except TypeError:
        raise PoolArgumentTypeError(
            f"trim() takes a whole number of tokens, got {type(n).__name__}") from None
    if count < 0:
        raise PoolArgumentError(f"trim() takes a token count >= 0, got {count}")
    return count


def require_plain_kv_model(model, cache_name: str, advice: str) -> None:
    """Refuse a model whose own ``make_cache()`` wants something other than ``KVCache``.

    Args:
        model: An mlx-lm model.
        cache_name: The pool-backed cache class that would replace the stock one.
        advice: What the caller should do instead (ends the message).

    Raises:
        ValueError: Naming the first layer that needs another cache type
            (sliding-window, SSM, ...).
    """
    if not hasattr(model, "make_cache"):
        return
    for index, stock in enumerate(model.make_cache()):
        if type(stock) is not _mlx_cache.KVCache:
            raise ValueError(
                f"layer {index} of this model needs a {type(stock).__name__}, which "
                f"{cache_name} cannot replace; {advice}"
            )


def tokens_to_grow(need: int, held: int, step: int) -> int:
    """Tokens to allocate so ``held`` covers ``need``, in whole ``step`` chunks."""
    return -(-(need - held) // step) * step


def allocate_kv(
    pool: BlockPoolAllocator, owner: int, n_tokens: int, fmt: str
) -> tuple[list[Block], list[Block]]:
    """Allocate ``n_tokens`` on both the ``"k"`` and the ``"v"`` stream, or neither.

    Raises:
        BlockPoolExhaustedError: One stream did not fit; nothing stays allocated.
    """
    # The stream with fewer free blocks first: on a split pool that cannot cover both
    # it is the one that fails, before the other's blocks are taken and given back
    # (which would move the allocation, free and peak counters for a call that failed).
    v_first = pool.config.separate_kv and pool.n_free("v") < pool.n_free("k")
    first, second = ("v", "k") if v_first else ("k", "v")
    taken = pool.allocate(first, n_tokens, owner, format=fmt)
    try:
        other = pool.allocate(second, n_tokens, owner, format=fmt)
    except BaseException:
        pool.free(taken)
        raise
    return (other, taken) if v_first else (taken, other)


def free_past(pool: BlockPoolAllocator, k: list[Block], v: list[Block], keep: int) -> None:
    """Give back every block from index ``keep`` on, on both streams (in place)."""
    if keep < len(k):
        pool.free(k[keep:] + v[keep:])
        del k[keep:], v[keep:]


def mark_used(k: list[Block], v: list[Block], first: int, tokens: int, block_size: int) -> None:
    """Set ``n_used`` of blocks ``first..`` so they hold exactly ``tokens`` tokens."""
    for i in range(first, len(k)):
        used = min(max(tokens - i * block_size, 0), block_size)
        kb, vb = k[i], v[i]
        # Only write on change: the setter takes the pool's lock.
        if kb.n_used != used:
            kb.n_used = used
        if vb.n_used != used:
            vb.n_used = used


def grow_buffer(
    old_keys: mx.array | None,
    old_values: mx.array | None,
    prev: int,
    keys: mx.array,
    values: mx.array,
    step: int,
) -> tuple[mx.array, mx.array]:
    """The key/value buffers extended by whole ``step`` chunks covering ``keys``.

    Rows past ``prev`` (stale after a trim) are dropped before extending, so
    they are never carried over. Growing by a chunk rather than by the new
    tokens keeps appends from copying the whole buffer every step.

    Args:
        old_keys: Current key buffer (``B, H, S, D``), or None when empty.
        old_values: Current value buffer, or None when empty.
        prev: Columns in use before this append.
        keys: The keys being appended (their shape sizes the new chunk).
        values: The values being appended.
        step: Growth chunk in columns.

    Returns:
        The new ``(keys, values)`` buffers.
    """
    batch, heads, n, k_dim = keys.shape
    extra = -(-n // step) * step
    new_k = mx.zeros((batch, heads, extra, k_dim), keys.dtype)
    new_v = mx.zeros((batch, heads, extra, values.shape[3]), values.dtype)
    if old_keys is None:
        return new_k, new_v
    if prev < old_keys.shape[2]:
        old_keys, old_values = old_keys[..., :prev, :], old_values[..., :prev, :]
    return (mx.concatenate([old_keys, new_k], axis=2),
            mx.concatenate([old_values, new_v], axis=2))


class ContiguousKVBuffer(_mlx_cache._BaseCache):
    """Keys and values in one contiguous buffer each, grown in whole chunks.

    Subclasses set ``keys``/``values`` to None (empty) in their constructor
    and write new columns with :meth:`_write_columns`.
    """

    keys: mx.array | None
    values: mx.array | None

    def _write_columns(self, prev: int, end: int, keys: mx.array, values: mx.array,
                       step: int) -> None:
        """Store ``keys``/``values`` in columns ``prev:end``, growing the buffer by ``step``."""
        if self.keys is None or end > self.keys.shape[2]:
            self.keys, self.values = grow_buffer(self.keys, self.values, prev, keys, values,
                                                 step)
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values

    def is_trimmable(self) -> bool:
        """Always True: trimming only moves the end of the written columns back."""
        return True

    def empty(self) -> bool:
        """True until the first append (or a state with arrays)."""
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers (growth room and any padding included)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes
