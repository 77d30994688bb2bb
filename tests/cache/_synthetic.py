"""Seeded synthetic K/V shaped like LLM caches, and exact attention to compare with."""

from __future__ import annotations

import numpy as np

OUTLIER_CHANNELS = (3, 17, 64, 100)


def make_kv(
    n: int, head_dim: int = 128, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys with a few large, offset outlier channels (as real key caches have),
    Gaussian values, and 4 Gaussian queries; all float32."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, head_dim)).astype(np.float32)
    for c in OUTLIER_CHANNELS:
        if c < head_dim:
            keys[:, c] = 6.0 * keys[:, c] + 4.0
    values = rng.standard_normal((n, head_dim)).astype(np.float32)
    queries = rng.standard_normal((4, head_dim)).astype(np.float32)
    return keys, values, queries


def exact_attention(queries: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """softmax(q K^T / sqrt(d)) V in float64."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    scores = q @ k.T / np.sqrt(k.shape[1])
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ v


def relative_error(approx: object, exact: np.ndarray) -> float:
    """Frobenius ``||approx - exact|| / ||exact||``."""
    diff = np.asarray(approx, dtype=np.float64) - exact
    return float(np.linalg.norm(diff) / np.linalg.norm(exact))
