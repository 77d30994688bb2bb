"""Lloyd-Max codebooks and the TurboQuant distortion anchors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from veloxquant_mlx.cache import KVCacheBuilder
from veloxquant_mlx.cache.codebooks import polar_angle_codebook, sphere_coordinate_codebook

# Lloyd-Max MSE of a unit Gaussian at 1..4 bits; the TurboQuant paper rounds
# them to 0.36, 0.117, 0.03, 0.009 for unit vectors.
ANCHORS = {1: 0.3635, 2: 0.1175, 3: 0.0345, 4: 0.0095}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_distortion_matches_turboquant_anchor(bits: int) -> None:
    book = sphere_coordinate_codebook(128, bits)
    assert 128 * book.distortion == pytest.approx(ANCHORS[bits], rel=0.05)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turboquant_mse_distortion_on_random_unit_vectors(bits: int) -> None:
    rng = np.random.default_rng(2024)
    units = rng.standard_normal((3000, 128)).astype(np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    cache = KVCacheBuilder().with_method("turboquant_mse").with_bits(bits).with_seed(5).build()
    cache.append_key(units)
    mse = float(np.mean(np.sum((np.array(cache.decode_keys()) - units) ** 2, axis=1)))
    assert mse == pytest.approx(ANCHORS[bits], rel=0.05)


def test_one_bit_codebook_is_the_known_closed_form() -> None:
    # 1 bit on a symmetric density: centroids +-E|t|; for N(0, 1/d), sqrt(2/(pi d)).
    book = sphere_coordinate_codebook(1024, 1)
    assert book.centroids[1] == pytest.approx(math.sqrt(2 / (math.pi * 1024)), rel=0.01)
    assert book.boundaries.tolist() == pytest.approx([0.0], abs=1e-9)


@pytest.mark.parametrize("bits", [2, 3])
def test_sphere_codebook_is_symmetric_and_sorted(bits: int) -> None:
    book = sphere_coordinate_codebook(64, bits)
    assert np.all(np.diff(book.centroids) > 0)
    np.testing.assert_allclose(book.centroids, -book.centroids[::-1], atol=1e-9)
    assert book.boundaries.size == 2**bits - 1


@pytest.mark.parametrize("level", [2, 3, 4])
def test_polar_angle_codebook_is_symmetric_about_pi_over_4(level: int) -> None:
    book = polar_angle_codebook(level, 2)
    np.testing.assert_allclose(book.centroids + book.centroids[::-1], math.pi / 2, atol=1e-6)
    assert 0 < book.centroids[0] < book.centroids[-1] < math.pi / 2


def test_higher_polar_levels_concentrate_more() -> None:
    spread = [np.ptp(polar_angle_codebook(level, 2).centroids) for level in (2, 3, 4)]
    assert spread[0] > spread[1] > spread[2]


def test_codebook_argument_errors() -> None:
    with pytest.raises(ValueError, match="dim >= 3"):
        sphere_coordinate_codebook(2, 1)
    with pytest.raises(ValueError, match="uniform"):
        polar_angle_codebook(1, 2)
