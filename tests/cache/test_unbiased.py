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


def _estimates(method: str, bits: int) -> tuple[np.ndarray, float]:
    key, query = _pair()
    out = []
    for seed in range(N_SEEDS):
        cache = KVCacheFactory.create(
            KVCacheConfig(method=method, head_dim=HEAD_DIM, bits=bits, seed=seed, group_size=16)
        )
        cache.append_key(key)
        out.append(cache.key_scores(mx.array(query[None, :])).item())
    return np.array(out), float(query @ key)


@pytest.mark.parametrize(("method", "bits"), [("qjl", 1), ("qjl", 2), ("turboquant_prod", 2),
                                              ("turboquant_prod", 3)])
def test_inner_product_estimator_is_unbiased(method: str, bits: int) -> None:
    est, exact = _estimates(method, bits)
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
