"""What is particular to one method: kivi's windows, polar's bit budget, spectral's basis."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.cache._synthetic import exact_attention, make_kv, relative_error
from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory
from veloxquant_mlx.cache.uniform import dequantize_groups, quantize_groups


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def test_kivi_windows_quantize_keys_in_blocks_and_values_as_they_age() -> None:
    keys, values, _ = make_kv(100)
    cache = KVCacheFactory.create(KVCacheConfig(method="kivi", residual_length=32, group_size=32))
    cache.append(keys[:40], values[:40])
    # Keys: one full 32-token window quantized, 8 waiting; values: the 8 oldest aged out.
    assert (cache.n_quantized_keys, cache.n_quantized_values) == (32, 8)
    cache.append(keys[40:95], values[40:95])
    assert (cache.n_quantized_keys, cache.n_quantized_values) == (64, 63)
    # The float16 windows hold the most recent tokens exactly (to float16).
    np.testing.assert_array_equal(np.array(cache.decode_keys())[64:], _fp16(keys[64:95]))
    np.testing.assert_array_equal(np.array(cache.decode_values())[63:], _fp16(values[63:95]))
    assert not np.allclose(np.array(cache.decode_values())[:63], values[:63], atol=1e-3)


def test_kivi_per_channel_keys_handle_outlier_channels_better_than_per_token() -> None:
    # The reason KIVI quantizes keys per channel: an outlier channel only
    # widens its own channel's range.
    keys, values, _ = make_kv(64)
    cache = KVCacheFactory.create(KVCacheConfig(method="kivi", bits=2, residual_length=32))
    cache.append(keys, values)
    quantized = np.array(cache.decode_keys())[:64]
    per_token = np.array(dequantize_groups(quantize_groups(mx.array(keys), 2, 32), 2, 32, 128))
    assert relative_error(quantized, keys) < 0.7 * relative_error(per_token, keys)


def test_qjl_splits_each_groups_largest_channels_and_keeps_the_tail_exact() -> None:
    keys, values, _ = make_kv(70)  # outlier channels 3, 17, 64, 100
    cache = KVCacheFactory.create(KVCacheConfig(method="qjl", outlier_channels=4))
    cache.append(keys, values)
    assert cache.n_sketched_keys == 64
    indices = np.array(cache._keys.indices.value())
    assert indices.shape == (2, 4)
    assert all(set(row) == {3, 17, 64, 100} for row in indices.tolist())
    np.testing.assert_array_equal(np.array(cache.decode_keys())[64:], _fp16(keys[64:]))


def test_polar_bit_budget_matches_the_paper() -> None:
    cache = KVCacheFactory.create(KVCacheConfig(method="polar", bits=4))
    assert cache.level_bits == (4, 2, 2, 2)
    assert cache.bits_per_coordinate() == 3.875
    cache.append(*make_kv(8)[:2])
    assert cache.memory_bytes() * 8 / (2 * 8 * 128) == 3.875


def test_polar_is_exact_up_to_angle_quantization_at_8_bits() -> None:
    keys, values, _ = make_kv(64)
    cache = KVCacheFactory.create(KVCacheConfig(method="polar", bits=8))
    cache.append(keys, values)
    assert relative_error(cache.decode_keys(), keys) < 0.015


def _low_rank(n: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((128, rank)))[0]
    coefs = rng.standard_normal((n, rank)) * np.linspace(4, 1, rank)
    return (coefs @ basis.T + 0.02 * rng.standard_normal((n, 128)) + 2.0).astype(np.float32)


def test_spectral_buffers_until_calibrated_then_compresses() -> None:
    keys, values = _low_rank(100, 8, 1), _low_rank(100, 8, 2)
    cache = KVCacheFactory.create(KVCacheConfig(method="spectral", calibration_tokens=64))
    cache.append(keys[:63], values[:63])
    assert cache.key_rank == 0 and cache.memory_bytes() == 2 * 63 * 128 * 2
    np.testing.assert_array_equal(np.array(cache.decode_keys()), _fp16(keys[:63]))
    cache.append(keys[63:], values[63:])
    assert 1 <= cache.key_rank <= 8 and cache.memory_bytes() < 2 * 100 * 128 * 2 // 2


def test_spectral_rank_and_energy_knobs_trade_memory_for_accuracy() -> None:
    keys, values = _low_rank(256, 8, 3), _low_rank(256, 8, 4)
    queries = np.random.default_rng(5).standard_normal((4, 128)).astype(np.float32)
    exact = exact_attention(queries, keys, values)
    results = {}
    for label, extra in {"energy": {"energy": 0.999}, "rank2": {"rank": 2}}.items():
        config = KVCacheConfig(method="spectral", calibration_tokens=64, **extra)
        cache = KVCacheFactory.create(config)
        cache.append(keys, values)
        results[label] = (cache, relative_error(cache.decode_keys(), keys),
                          relative_error(cache.attend(queries), exact))
    full, low = results["energy"], results["rank2"]
    assert full[0].key_rank == 8 and low[0].key_rank == 2
    assert full[1] < 0.02 and full[2] < 0.01
    assert low[1] > 5 * full[1]
    assert low[0].memory_bytes() < full[0].memory_bytes()


@pytest.mark.parametrize("energy", [0.5, 0.9])
def test_spectral_energy_picks_the_smallest_sufficient_rank(energy: float) -> None:
    keys = _low_rank(128, 8, 6)
    cache = KVCacheFactory.create(
        KVCacheConfig(method="spectral", calibration_tokens=128, energy=energy)
    )
    cache.append(keys, keys)
    centered = keys - keys.mean(axis=0)
    sv = np.linalg.svd(centered, compute_uv=False) ** 2
    kept = np.cumsum(sv) / sv.sum()
    assert cache.key_rank == int(np.argmax(kept >= energy)) + 1
