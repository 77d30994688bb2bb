"""The VeloxQuant ``KVCache`` ABC: one attention head's compressed K/V store.

This is VeloxQuant's own cache interface, distinct from mlx-lm's
``update_and_fetch`` protocol. One instance holds the keys and values of a
single attention head:

* ``append_key(k)`` / ``append_value(v)``: ``k`` of shape ``(head_dim,)`` (one
  token) or ``(n, head_dim)`` (n tokens, oldest first).
* ``attend(query)``: ``query`` of shape ``(head_dim,)`` or ``(q, head_dim)``;
  returns ``softmax(query @ K^T / sqrt(head_dim)) @ V`` with the same leading
  shape as ``query``, computed from the compressed representation.
* ``memory_bytes()``: bytes of everything stored per token (packed codes,
  float16 scales/norms, full-precision windows, data-dependent bases).
  Seeded constants (rotations, projections, codebooks) are regenerated from
  the seed and not counted.
* ``len(cache)``: complete (key, value) tokens, ``min(n_keys, n_values)``.

Subclasses implement the ``_append_*`` hooks, ``decode_*``, ``memory_bytes``
and ``format``; they may override :meth:`KVCache.key_scores` and
:meth:`KVCache.combine_values` to work in their compressed domain.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

# ``config`` arguments below are builder.KVCacheConfig objects, untyped here as in every
# method's module: the builder imports the caches, so they do not import it back.

#: Methods that exist only as VeloxQuant ``KVCache`` implementations (mlx-lm's
#: ``generate()`` never drives them); ``kivi`` implements the same ABC too.
STANDALONE_METHODS: tuple[str, ...] = (
    "turboquant_prod",
    "turboquant_mse",
    "polar",
    "qjl",
    "spectral",
)


class ChunkList:
    """Rows appended in chunks, concatenated lazily when read.

    Reading compacts the parts into one array, so a decode loop that attends
    after every append copies each row O(1) times per read, as mlx-lm's own
    growing caches do.
    """

    def __init__(self) -> None:
        self._parts: list[mx.array] = []
        self.rows = 0
        self.nbytes = 0

    def append(self, part: mx.array) -> None:
        """Add ``part`` (rows along axis 0)."""
        self._parts.append(part)
        self.rows += part.shape[0]
        self.nbytes += part.nbytes

    def value(self) -> mx.array | None:
        """All rows as one array, or ``None`` when empty."""
        if not self._parts:
            return None
        if len(self._parts) > 1:
            self._parts = [mx.concatenate(self._parts, axis=0)]
        return self._parts[0]

    def replace(self, value: mx.array | None) -> None:
        """Replace the content with ``value`` (``None`` empties the list)."""
        self._parts = [] if value is None or value.shape[0] == 0 else [value]
        self.rows = 0 if not self._parts else value.shape[0]
        self.nbytes = 0 if not self._parts else value.nbytes


def as_rows(x: object, head_dim: int, what: str) -> mx.array:
    """Validate a vector or a stack of vectors and return ``(n, head_dim)`` float32.

    Args:
        x: ``mx.array``, numpy array or nested list of shape ``(head_dim,)`` or
            ``(n, head_dim)``.
        head_dim: Expected last dimension.
        what: Name used in the error message ("key", "value", "query").

    Raises:
        ValueError: On a wrong rank, a wrong last dimension or an empty input.
    """
    arr = x if isinstance(x, mx.array) else mx.array(np.asarray(x, dtype=np.float32))
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[-1] != head_dim or arr.shape[0] == 0:
        raise ValueError(
            f"{what} must have shape ({head_dim},) or (n, {head_dim}) with n >= 1, got "
            f"{tuple(arr.shape)}; this cache holds one head of head_dim={head_dim}"
        )
    return arr.astype(mx.float32)


class KVCache(ABC):
    """One attention head's compressed key/value cache (see module docstring).

    Invariants: ``n_keys`` / ``n_values`` count appended rows; the decoded
    arrays have exactly that many rows; ``memory_bytes()`` equals the sum of
    the stored arrays' ``nbytes``.
    """

    #: Registry name of the method ("kivi", "turboquant_mse", ...).
    method: ClassVar[str] = ""
    #: Inclusive range of ``bits`` the method accepts, and its default.
    bits_range: ClassVar[tuple[int, int]] = (1, 8)
    default_bits: ClassVar[int] = 4

    def __init__(self, config) -> None:
        self.config = config
        self.head_dim = config.head_dim
        self.bits = int(config.bits if config.bits is not None else self.default_bits)

    @classmethod
    def head_dim_error(cls, config) -> str | None:
        """Say why ``config.head_dim`` is unsupported, or ``None`` if it is fine."""
        return None

    @classmethod
    def knob_error(cls, config) -> str | None:
        """Say which of the method's other settings is unusable (naming it), or ``None``."""
        return None

    # ------------------------------------------------------------------ public
    @property
    @abstractmethod
    def format(self) -> str:
        """Compression-format tag recorded on pool blocks ("int2", "tq3", ...)."""

    @property
    @abstractmethod
    def n_keys(self) -> int:
        """Key rows stored."""

    @property
    @abstractmethod
    def n_values(self) -> int:
        """Value rows stored."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of per-token storage (see module docstring)."""

    @abstractmethod
    def decode_keys(self) -> mx.array:
        """Reconstructed keys, float32 ``(n_keys, head_dim)``."""

    @abstractmethod
    def decode_values(self) -> mx.array:
        """Reconstructed values, float32 ``(n_values, head_dim)``."""

    def append_key(self, k: object) -> None:
        """Compress and store one key ``(head_dim,)`` or a chunk ``(n, head_dim)``."""
        self._append_keys(as_rows(k, self.head_dim, "key"))

    def append_value(self, v: object) -> None:
        """Compress and store one value ``(head_dim,)`` or a chunk ``(n, head_dim)``."""
        self._append_values(as_rows(v, self.head_dim, "value"))

    def append(self, k: object, v: object) -> None:
        """Append keys and values for the same tokens (shapes must match)."""
        keys, values = self._paired_rows(k, v)
        self.append_key(keys)
        self.append_value(values)

    def _paired_rows(self, k: object, v: object) -> tuple[mx.array, mx.array]:
        """``append``'s arguments as rows, checked to be the same number of tokens."""
        keys = as_rows(k, self.head_dim, "key")
        values = as_rows(v, self.head_dim, "value")
        if keys.shape[0] != values.shape[0]:
            raise ValueError(
                f"append got {keys.shape[0]} key row(s) but {values.shape[0]} value row(s); "
                "pass the same tokens' keys and values, or use append_key/append_value"
            )
        return keys, values

    def key_scores(self, queries: mx.array) -> mx.array:
        """Estimated raw inner products ``queries @ K^T``, shape ``(q, n_keys)``."""
        return queries @ self.decode_keys().T

    def combine_values(self, probs: mx.array) -> mx.array:
        """``probs @ V`` for attention weights ``probs`` of shape ``(q, n_values)``."""
        return probs @ self.decode_values()

    def attend(self, query: object) -> mx.array:
        """Scaled dot-product attention of ``query`` over the cached tokens.

        Args:
            query: ``(head_dim,)`` or ``(q, head_dim)``.

        Returns:
            float32 attention output with the query's leading shape.

        Raises:
            ValueError: If the cache is empty, keys and values are out of step,
                or the query shape is wrong.
        """
        single = (isinstance(query, mx.array) and query.ndim == 1) or (
            not isinstance(query, mx.array) and np.asarray(query).ndim == 1
        )
        q = as_rows(query, self.head_dim, "query")
        if self.n_keys != self.n_values or self.n_keys == 0:
            raise ValueError(
                f"attend needs the same non-zero number of keys and values, have "
                f"{self.n_keys} key(s) and {self.n_values} value(s); append both first"
            )
        probs = mx.softmax(self.key_scores(q) / math.sqrt(self.head_dim), axis=-1)
        out = self.combine_values(probs)
        return out[0] if single else out

    def __len__(self) -> int:
        return min(self.n_keys, self.n_values)

    # ------------------------------------------------------------------- hooks
    @abstractmethod
    def _append_keys(self, keys: mx.array) -> None:
        """Store validated float32 keys ``(n, head_dim)``."""

    @abstractmethod
    def _append_values(self, values: mx.array) -> None:
        """Store validated float32 values ``(n, head_dim)``."""


class TwoStreamCache(KVCache):
    """A cache whose keys and values are two code streams of one kind.

    Subclasses set ``self._keys`` and ``self._values`` to objects with
    ``rows`` (rows stored) and ``nbytes`` (bytes of everything stored).
    """

    _keys: Any
    _values: Any

    @property
    def n_keys(self) -> int:
        return self._keys.rows

    @property
    def n_values(self) -> int:
        return self._values.rows

    def memory_bytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes


class RotatedTwoStreamCache(TwoStreamCache):
    """Two streams coded in a basis rotated by the orthogonal ``self.rotation``.

    Streams expose ``decode_rotated()``. Attention runs in the rotated basis
    (R orthogonal, so q.k = (q R^T).(k R^T)): one rotation per query instead
    of one per cached token.
    """

    rotation: mx.array

    def _rotated_keys(self) -> mx.array:
        return self._keys.decode_rotated()

    def key_scores(self, queries: mx.array) -> mx.array:
        return (queries @ self.rotation.T) @ self._rotated_keys().T

    def combine_values(self, probs: mx.array) -> mx.array:
        return (probs @ self._values.decode_rotated()) @ self.rotation

    def decode_keys(self) -> mx.array:
        return self._rotated_keys() @ self.rotation

    def decode_values(self) -> mx.array:
        return self._values.decode_rotated() @ self.rotation
