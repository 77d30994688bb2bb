"""Lloyd-Max scalar codebooks for the distributions the rotation methods see.

After a random rotation, each coordinate of a unit vector in ``R^d`` follows
the density ``f(t) ∝ (1 - t^2)^((d-3)/2)`` on ``[-1, 1]`` (a shifted Beta,
close to ``N(0, 1/d)`` for large ``d``); TurboQuant quantizes each coordinate
with the Lloyd-Max (MSE-optimal scalar) codebook of that density. PolarQuant's
level-``l`` angles (``l >= 2``) follow ``f(psi) ∝ sin(2 psi)^(2^(l-1) - 1)`` on
``[0, pi/2]``. Both codebooks are computed once per (density, bits) with
numpy on a fine grid and cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_GRID = 200_001
_MAX_ITERS = 2_000
_TOL = 1e-12


@dataclass(frozen=True, slots=True)
class Codebook:
    """A scalar quantizer: reconstruction points and decision thresholds.

    Attributes:
        centroids: ``2**bits`` increasing reconstruction values.
        boundaries: ``2**bits - 1`` thresholds; a value ``t`` gets code
            ``#{boundaries < t}``.
        distortion: Expected squared error ``E[(t - Q(t))^2]`` under the density.
    """

    centroids: np.ndarray
    boundaries: np.ndarray
    distortion: float


def lloyd_max(grid: np.ndarray, density: np.ndarray, bits: int) -> Codebook:
    """Run Lloyd-Max iterations for a density sampled on a uniform grid.

    Alternates the two optimality conditions: thresholds at midpoints of
    neighbouring centroids, centroids at the conditional mean of their cell.
    Cumulative sums make each iteration O(levels log grid).

    Args:
        grid: Increasing, uniformly spaced sample points of the support.
        density: Non-negative density values at ``grid`` (need not integrate to 1).
        bits: Codebook size is ``2**bits``.

    Returns:
        The converged :class:`Codebook`.
    """
    w = density / density.sum()
    # Cumulative moments at the cell edges around each grid point; linear
    # interpolation between edges is exact for a piecewise-constant density,
    # so thresholds need not fall on grid points (keeps symmetric books symmetric).
    h = grid[1] - grid[0]
    edges = np.concatenate([[grid[0] - h / 2], grid + h / 2])
    m0 = np.concatenate([[0.0], np.cumsum(w)])
    m1 = np.concatenate([[0.0], np.cumsum(w * grid)])
    m2 = np.concatenate([[0.0], np.cumsum(w * grid * grid)])

    def cells(moment: np.ndarray, cuts: np.ndarray) -> np.ndarray:
        at = np.interp(np.concatenate([[edges[0]], cuts, [edges[-1]]]), edges, moment)
        return np.diff(at)

    levels = 2**bits
    # Start at the cell-midpoint quantiles, which is already near optimal.
    centroids = np.interp((np.arange(levels) + 0.5) / levels, m0, edges)
    for _ in range(_MAX_ITERS):
        boundaries = 0.5 * (centroids[1:] + centroids[:-1])
        mass = cells(m0, boundaries)
        new = np.where(mass > 0, cells(m1, boundaries) / np.maximum(mass, 1e-300), centroids)
        done = np.max(np.abs(new - centroids)) < _TOL
        centroids = new
        if done:
            break
    boundaries = 0.5 * (centroids[1:] + centroids[:-1])
    # E[(t-c)^2] per cell = M2 - 2c M1 + c^2 M0 over that cell.
    d0, d1, d2 = (cells(m, boundaries) for m in (m0, m1, m2))
    distortion = float(np.sum(d2 - 2 * centroids * d1 + centroids**2 * d0))
    return Codebook(centroids.astype(np.float64), boundaries.astype(np.float64), distortion)


@lru_cache(maxsize=64)
def sphere_coordinate_codebook(dim: int, bits: int) -> Codebook:
    """Lloyd-Max codebook for one coordinate of a random unit vector in ``R^dim``.

    Args:
        dim: Ambient dimension (the head dimension), at least 3.
        bits: Bits per coordinate.

    Returns:
        The codebook; ``dim * distortion`` is the expected squared error of a
        whole unit vector quantized coordinate by coordinate.
    """
    if dim < 3:
        raise ValueError(f"the sphere-coordinate density needs dim >= 3, got {dim}")
    # The density is negligible beyond ~14 standard deviations (1/sqrt(dim)).
    half = min(1.0, 14.0 / math.sqrt(dim))
    grid = np.linspace(-half, half, _GRID)
    log_f = 0.5 * (dim - 3) * np.log1p(-np.minimum(grid * grid, 1 - 1e-15))
    return lloyd_max(grid, np.exp(log_f - log_f.max()), bits)


@lru_cache(maxsize=64)
def polar_angle_codebook(level: int, bits: int) -> Codebook:
    """Lloyd-Max codebook for a PolarQuant angle at ``level >= 2``.

    Args:
        level: Polar-transform level (2 pairs level-1 radii, 3 pairs level-2...).
        bits: Bits per angle.

    Returns:
        A codebook over ``[0, pi/2]``.
    """
    if level < 2:
        raise ValueError("level-1 angles are uniform on [0, 2pi); use a uniform quantizer")
    grid = np.linspace(0.0, math.pi / 2, _GRID)
    power = 2 ** (level - 1) - 1
    return lloyd_max(grid, np.sin(2 * grid) ** power, bits)
