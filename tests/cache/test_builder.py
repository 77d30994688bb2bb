"""KVCacheConfig validation, KVCacheFactory registry, KVCacheBuilder."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, KVCacheFactory
from veloxquant_mlx.cache import STANDALONE_METHODS, KVCache, TurboQuantMSECache

ALL_METHODS = ["kivi", "polar", "qjl", "spectral", "turboquant_mse", "turboquant_prod"]


def test_available_methods_cover_standalone_and_kivi() -> None:
    assert KVCacheFactory.available_methods() == ALL_METHODS
    assert set(STANDALONE_METHODS) | {"kivi"} == set(ALL_METHODS)


def test_unknown_method_names_the_valid_choices() -> None:
    pattern = r"unknown KV-cache method 'zip'.*'kivi'.*'turboquant_prod'"
    with pytest.raises(ValueError, match=pattern):
        KVCacheConfig(method="zip")


@pytest.mark.parametrize(
    ("method", "bad_bits", "valid"),
    [
        ("kivi", 1, "[2, 3, 4, 5, 6, 7, 8]"),
        ("turboquant_mse", 9, "[1, 2, 3, 4, 5, 6, 7, 8]"),
        ("turboquant_prod", 1, "[2, 3, 4, 5, 6, 7, 8]"),
        ("polar", 0, "[2, 3, 4, 5, 6, 7, 8]"),
    ],
)
def test_bits_out_of_range_names_valid_choices(method: str, bad_bits: int, valid: str) -> None:
    with pytest.raises(ValueError, match=f"out of range for method '{method}'") as info:
        KVCacheConfig(method=method, bits=bad_bits)
    assert valid in str(info.value)


@pytest.mark.parametrize(
    ("method", "head_dim", "hint"),
    [
        ("polar", 100, "multiple of 16"),
        ("kivi", 100, "multiple of group_size"),
        ("qjl", 48, "multiple of group_size"),
    ],
)
def test_unsupported_head_dim(method: str, head_dim: int, hint: str) -> None:
    pattern = f"head_dim={head_dim} is not supported by '{method}'.*{hint}"
    with pytest.raises(ValueError, match=pattern):
        KVCacheConfig(method=method, head_dim=head_dim)


def test_head_dim_supported_where_valid() -> None:
    assert KVCacheConfig(method="turboquant_mse", head_dim=100).head_dim == 100
    assert KVCacheConfig(method="qjl", head_dim=48, group_size=16).head_dim == 48


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("head_dim", 2, "head_dim must be an int >= 4"),
        ("group_size", 0, "group_size must be >= 1"),
        ("residual_length", -1, "residual_length must be >= 0"),
        ("rank", 0, "rank must be >= 1"),
        ("energy", 1.5, r"energy must be in \(0, 1\]"),
        ("calibration_tokens", 1, "calibration_tokens must be >= 2"),
        ("outlier_channels", -1, "outlier_channels must be >= 0"),
    ],
)
def test_knob_validation(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(method="spectral", **{field: value})


def test_kivi_residual_must_be_multiple_of_group() -> None:
    with pytest.raises(ValueError, match="residual_length.*multiple of group_size"):
        KVCacheConfig(method="kivi", residual_length=48, group_size=32)


@pytest.mark.parametrize(
    ("method", "bits", "fmt"),
    [
        ("kivi", 2, "int2"),
        ("turboquant_mse", 3, "tq3"),
        ("turboquant_prod", 3, "tqp3"),
        ("qjl", 1, "qjl1"),
        ("polar", 4, "polar4"),
        ("spectral", 4, "svd4"),
    ],
)
def test_builder_builds_each_method_with_its_format(method: str, bits: int, fmt: str) -> None:
    cache = KVCacheBuilder().with_method(method).with_head_dim(64).with_bits(bits).build()
    assert isinstance(cache, KVCacheFactory.method_class(method))
    assert cache.format == fmt and cache.bits == bits and cache.head_dim == 64


def test_default_bits_are_filled_in() -> None:
    assert KVCacheConfig(method="kivi").bits == 2
    assert KVCacheConfig(method="turboquant_mse").bits == 4


def test_builder_sets_every_field_and_config_is_frozen() -> None:
    config = (
        KVCacheBuilder()
        .with_method("spectral")
        .with_head_dim(64)
        .with_bits(3)
        .with_group_size(16)
        .with_residual_length(32)
        .with_seed(9)
        .with_rank(5)
        .with_energy(0.5)
        .with_calibration_tokens(40)
        .with_outlier_channels(3)
        .config()
    )
    assert config == KVCacheConfig("spectral", 64, 3, 16, 32, 9, 5, 0.5, 40, 3)
    assert KVCacheBuilder().with_config(config).config() == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bits = 4  # type: ignore[misc]


def test_builder_validates_on_build() -> None:
    with pytest.raises(ValueError, match="valid choices"):
        KVCacheBuilder().with_method("kivi").with_bits(1).build()


def test_register_custom_method_and_reject_non_caches() -> None:
    class Doubled(TurboQuantMSECache):
        method = "doubled_test"

    KVCacheFactory.register("doubled_test", Doubled)
    try:
        cache = KVCacheBuilder().with_method("doubled_test").with_head_dim(32).build()
        assert isinstance(cache, Doubled)
        cache.append(mx.ones((2, 32)), mx.ones((2, 32)))
        assert len(cache) == 2
    finally:
        KVCacheFactory._registry.pop("doubled_test")
    with pytest.raises(TypeError, match="not a KVCache subclass"):
        KVCacheFactory.register("bad", dict)  # type: ignore[arg-type]
    assert issubclass(Doubled, KVCache)


def test_qjl_needs_fewer_outlier_channels_than_head_dim() -> None:
    with pytest.raises(ValueError, match="outlier_channels=64 must be below head_dim"):
        KVCacheConfig(method="qjl", head_dim=64, outlier_channels=64)
