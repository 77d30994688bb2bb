"""Unbiased inner-product estimators (qjl, turboquant_prod), averaged over seeds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory

N_SEEDS = 400
HEAD_DIM = 64


def _pair() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(123)
    key = rng.standard_normal(HEAD_DIM).astype(np.float32)
    query = rng.standard_normal(HEAD_DIM).astype(np.float32)
    # Correlate them so the true inner product is large next to its noise.
    query = (query + 0.6 * np.linalg.norm(query) * key / np.linalg.norm(key)).astype(np.float32)
    return key, query


def _estimates(method: str, bits: int, outliers: int = 0) -> tuple[np.ndarray, float]:
    key, query = _pair()
    # qjl's outlier split works on whole groups of 16 keys: the key under test
    # goes first in a group whose other keys share its outlier channels.
    rng = np.random.default_rng(9)
    group = np.concatenate([key[None, :], rng.standard_normal((15, HEAD_DIM))]).astype(np.float32)
    group[:, :3] *= 8.0
    key = group[0]
    out = []
    for seed in range(N_SEEDS):
        cache = KVCacheFactory.create(
            KVCacheConfig(method=method, head_dim=HEAD_DIM, bits=bits, seed=seed, group_size=16,
                          outlier_channels=outliers)
        )
        cache.append_key(group)
        out.append(cache.key_scores(mx.array(query[None, :]))[0, 0].item())
    return np.array(out), float(query @ key)


@pytest.mark.parametrize(
    ("method", "bits", "outliers"),
    [("qjl", 1, 0), ("qjl", 2, 0), ("qjl", 1, 4), ("qjl", 2, 4), ("turboquant_prod", 2, 0),
     ("turboquant_prod", 3, 0)],
)
def test_inner_product_estimator_is_unbiased(method: str, bits: int, outliers: int) -> None:
    est, exact = _estimates(method, bits, outliers)
    stderr = est.std(ddof=1) / np.sqrt(N_SEEDS)
    # Mean within 4 standard errors of the truth, and within 3% of it.
    assert abs(est.mean() - exact) < 4 * stderr
    assert est.mean() == pytest.approx(exact, rel=0.03)
    # Individual estimates do vary: the test is about the mean, not luck.
    assert est.std() > 0.01 * abs(exact)


def test_mse_quantizer_is_biased_which_prod_corrects() -> None:
    # At 1 bit TurboQuant-MSE shrinks inner products by about 2/pi.
    est, exact = _estimates("turboquant_mse", 1)
    stderr = est.std(ddof=1) / np.sqrt(N_SEEDS)
    assert abs(est.mean() - exact) > 20 * stderr
    assert est.mean() / exact == pytest.approx(2 / np.pi, rel=0.05)


def test_qjl_outlier_split_cuts_the_estimator_noise() -> None:
    # The group's keys carry 3 outlier channels; sketching them apart pairs
    # their norm with only the query's outlier coordinates.
    plain, exact = _estimates("qjl", 2, 0)
    split, _ = _estimates("qjl", 2, 4)
    assert split.std() < 0.7 * plain.std()
    assert abs(split.mean() - exact) < abs(exact) * 0.03
