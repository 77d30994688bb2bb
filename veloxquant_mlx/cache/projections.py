"""Seeded random matrices shared by the data-oblivious methods.

They are regenerated from the seed, never stored per token, so
``memory_bytes`` of a cache does not count them (like a model's weights).
Each matrix kind mixes a fixed salt into the seed: otherwise a caller who
draws test data from ``default_rng(seed)`` would get data built from the very
same Gaussian draws as the rotation, which breaks its randomness.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

_ORTHOGONAL_SALT = 0x0A7A
_GAUSSIAN_SALT = 0x6A55


@lru_cache(maxsize=32)
def _orthogonal_np(dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, _ORTHOGONAL_SALT])
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    # Fixing the signs of R's diagonal makes Q Haar-distributed (uniform rotation).
    return (q * np.sign(np.diag(r))).astype(np.float32)


def random_orthogonal(dim: int, seed: int) -> mx.array:
    """Haar-random ``dim x dim`` orthogonal matrix, deterministic in ``seed``."""
    return mx.array(_orthogonal_np(dim, seed))


def random_gaussian(rows: int, cols: int, seed: int, stream: int = 0) -> mx.array:
    """``rows x cols`` matrix of i.i.d. N(0, 1) entries, deterministic in ``seed``.

    Args:
        rows: Output rows.
        cols: Output columns.
        seed: The cache's seed.
        stream: Distinguishes several Gaussian matrices drawn for one seed.
    """
    rng = np.random.default_rng([seed, _GAUSSIAN_SALT, stream])
    return mx.array(rng.standard_normal((rows, cols)).astype(np.float32))
