"""PolarQuant (Han et al., 2025): random preconditioning + recursive polar transform.

Each vector is rotated by a seeded Haar-random orthogonal matrix, then split
into blocks of 16 coordinates; each block goes through 4 levels of polar
transform::

    level 1:  (x0,x1) (x2,x3) ... (x14,x15)  -> 8 angles in [0, 2pi), 8 radii
    level 2:  (r0,r1) (r2,r3) ...            -> 4 angles in [0, pi/2], 4 radii
    level 3:                                 -> 2 angles, 2 radii
    level 4:                                 -> 1 angle, 1 radius (float16)

After preconditioning the coordinates behave like i.i.d. Gaussians, so the
level-1 angle is uniform (quantized uniformly) and the level-l angle has
density ∝ sin(2 psi)^(2^(l-1)-1), concentrated around pi/4 (quantized with
its Lloyd-Max codebook). No per-block scale or zero point is stored, only the
block radius. Level 1 uses ``bits`` bits, levels 2-4 ``max(1, bits - 2)``;
``bits=4`` is the paper's 4/2/2/2 split, 3.875 bits per coordinate.
Keys and values are both stored this way.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache.base import ChunkList, RotatedTwoStreamCache
from veloxquant_mlx.cache.codebooks import polar_angle_codebook
from veloxquant_mlx.cache.packing import pack_bits, packed_row_bytes, unpack_bits
from veloxquant_mlx.cache.projections import random_orthogonal

LEVELS = 4
BLOCK = 2**LEVELS


class PolarStream:
    """One stream of polar codes: angle codes per level plus block radii."""

    def __init__(self, rotation: mx.array, level_bits: tuple[int, ...]) -> None:
        self.rotation = rotation
        self.dim = rotation.shape[0]
        self.level_bits = level_bits
        self.edges = [None] + [
            mx.array(polar_angle_codebook(lv + 1, b).boundaries.astype("float32"))
            for lv, b in enumerate(level_bits) if lv > 0
        ]
        # Decoding needs only cos/sin of each reconstruction angle: one table
        # per level turns the per-attend trigonometry into a gather.
        self.trig = [self._trig_table(lv, b) for lv, b in enumerate(level_bits)]
        self.angles = [ChunkList() for _ in range(LEVELS)]
        self.radii = ChunkList()

    @staticmethod
    def _trig_table(level: int, bits: int) -> tuple[mx.array, mx.array]:
        if level == 0:
            angles = (np.arange(2**bits) + 0.5) * (2 * math.pi / 2**bits)
        else:
            angles = polar_angle_codebook(level + 1, bits).centroids
        cos, sin = np.cos(angles).astype("float32"), np.sin(angles).astype("float32")
        return mx.array(cos), mx.array(sin)

    @property
    def rows(self) -> int:
        return self.radii.rows

    @property
    def nbytes(self) -> int:
        return self.radii.nbytes + sum(a.nbytes for a in self.angles)

    def encode(self, x: mx.array) -> None:
        n = x.shape[0]
        r = (x @ self.rotation.T).reshape(n, self.dim // BLOCK, BLOCK)
        for level in range(LEVELS):
            a, b = r[..., 0::2], r[..., 1::2]
            angle = mx.arctan2(b, a)
            bits = self.level_bits[level]
            if level == 0:
                # Uniform cells over [0, 2pi) are Lloyd-Max optimal for a uniform angle.
                turns = mx.remainder(angle, 2 * math.pi) / (2 * math.pi)
                codes = mx.clip(mx.floor(turns * 2**bits), 0, 2**bits - 1)
            else:
                codes = (angle[..., None] > self.edges[level]).sum(axis=-1)
            self.angles[level].append(pack_bits(codes.reshape(n, -1), bits))
            r = mx.sqrt(a * a + b * b)
        self.radii.append(r.reshape(n, -1).astype(mx.float16))

    def decode_rotated(self) -> mx.array:
        """Reconstructed vectors in the rotated basis, float32 ``(rows, dim)``."""
        n, blocks = self.rows, self.dim // BLOCK
        r = self.radii.value().astype(mx.float32).reshape(n, blocks, 1)
        for level in reversed(range(LEVELS)):
            bits = self.level_bits[level]
            width = BLOCK >> (level + 1)
            codes = unpack_bits(self.angles[level].value(), bits, blocks * width)
            codes = codes.reshape(n, blocks, width).astype(mx.uint32)
            cos, sin = self.trig[level]
            r = mx.stack([r * cos[codes], r * sin[codes]], axis=-1).reshape(n, blocks, -1)
        return r.reshape(n, self.dim)


class PolarQuantCache(RotatedTwoStreamCache):
    """PolarQuant keys and values; ``format`` is ``"polar{bits}"``."""

    method = "polar"
    bits_range = (2, 8)
    default_bits = 4

    @classmethod
    def head_dim_error(cls, config) -> str | None:
        if config.head_dim % BLOCK:
            return f"polar transforms blocks of {BLOCK} coordinates; use a multiple of {BLOCK}"
        return None

    def __init__(self, config) -> None:
        super().__init__(config)
        self.level_bits = (self.bits,) + (max(1, self.bits - 2),) * (LEVELS - 1)
        self.rotation = random_orthogonal(self.head_dim, config.seed)
        self._keys = PolarStream(self.rotation, self.level_bits)
        self._values = PolarStream(self.rotation, self.level_bits)

    @property
    def format(self) -> str:
        return f"polar{self.bits}"

    def bits_per_coordinate(self) -> float:
        """Angle bits plus the float16 block radius, per coordinate."""
        angle_bits = sum((BLOCK >> (lv + 1)) * b for lv, b in enumerate(self.level_bits))
        return (angle_bits + 16) / BLOCK

    def expected_memory_bytes(self) -> int:
        """Closed form: packed angle rows per level plus float16 radii."""
        blocks = self.head_dim // BLOCK
        per_row = blocks * 2 + sum(
            packed_row_bytes(blocks * (BLOCK >> (lv + 1)), b)
            for lv, b in enumerate(self.level_bits)
        )
        return (self.n_keys + self.n_values) * per_row

    def _append_keys(self, keys: mx.array) -> None:
        self._keys.encode(keys)
        mx.eval(self._keys.radii.value(), *(a.value() for a in self._keys.angles))

    def _append_values(self, values: mx.array) -> None:
        self._values.encode(values)
        mx.eval(self._values.radii.value(), *(a.value() for a in self._values.angles))
