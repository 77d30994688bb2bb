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


class PolarTables:
    """The seeded constants of PolarQuant at one head_dim and bit split.

    Shared by the per-request stream and the pool's format, so both code a
    vector the same way: the rotation, each level's decision edges (levels
    2-4; level 1 is uniform), and cos/sin of each reconstruction angle.
    """

    def __init__(self, dim: int, level_bits: tuple[int, ...], seed: int) -> None:
        self.dim = dim
        self.blocks = dim // BLOCK
        self.level_bits = level_bits
        self.rotation = random_orthogonal(dim, seed)
        self.edges = [None] + [
            mx.array(polar_angle_codebook(lv + 1, b).boundaries.astype("float32"))
            for lv, b in enumerate(level_bits) if lv > 0
        ]
        # Decoding needs only cos/sin of each reconstruction angle: one table
        # per level turns the per-attend trigonometry into a gather.
        self.trig = [self._trig_table(lv, b) for lv, b in enumerate(level_bits)]

    @staticmethod
    def _trig_table(level: int, bits: int) -> tuple[mx.array, mx.array]:
        if level == 0:
            angles = (np.arange(2**bits) + 0.5) * (2 * math.pi / 2**bits)
        else:
            angles = polar_angle_codebook(level + 1, bits).centroids
        cos, sin = np.cos(angles).astype("float32"), np.sin(angles).astype("float32")
        return mx.array(cos), mx.array(sin)

    def angle_codes(self, x: mx.array) -> tuple[list[mx.array], mx.array]:
        """Code ``x`` (``n, dim``): each level's angle codes ``(n, blocks x width)``
        and the float16 block radii ``(n, blocks)``."""
        n = x.shape[0]
        r = (x @ self.rotation.T).reshape(n, self.blocks, BLOCK)
        codes_per_level = []
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
            codes_per_level.append(codes.reshape(n, -1))
            r = mx.sqrt(a * a + b * b)
        return codes_per_level, r.reshape(n, -1).astype(mx.float16)

    def rotated_points(self, codes_per_level: list[mx.array], radii: mx.array) -> mx.array:
        """Invert :meth:`angle_codes` into the rotated basis, float32 ``(n, dim)``."""
        n = radii.shape[0]
        r = radii.astype(mx.float32).reshape(n, self.blocks, 1)
        for level in reversed(range(LEVELS)):
            width = BLOCK >> (level + 1)
            codes = codes_per_level[level].reshape(n, self.blocks, width).astype(mx.uint32)
            cos, sin = self.trig[level]
            r = mx.stack([r * cos[codes], r * sin[codes]], axis=-1).reshape(n, self.blocks, -1)
        return r.reshape(n, self.dim)

    def level_widths(self) -> list[int]:
        """Angle codes per row at each level."""
        return [self.blocks * (BLOCK >> (lv + 1)) for lv in range(LEVELS)]

    def level_bytes(self) -> list[int]:
        """Bytes of one row's packed angle codes at each level."""
        return [packed_row_bytes(w, b) for w, b
                in zip(self.level_widths(), self.level_bits, strict=True)]


class PolarStream:
    """One stream of polar codes: packed angle codes per level plus block radii."""

    def __init__(self, tables: PolarTables) -> None:
        self.tables = tables
        self.dim = tables.dim
        self.level_bits = tables.level_bits
        self.angles = [ChunkList() for _ in range(LEVELS)]
        self.radii = ChunkList()

    @property
    def rows(self) -> int:
        return self.radii.rows

    @property
    def nbytes(self) -> int:
        return self.radii.nbytes + sum(a.nbytes for a in self.angles)

    def encode(self, x: mx.array) -> None:
        codes_per_level, radii = self.tables.angle_codes(x)
        for chunks, codes, bits in zip(self.angles, codes_per_level, self.level_bits,
                                       strict=True):
            chunks.append(pack_bits(codes, bits))
        self.radii.append(radii)

    def decode_rotated(self) -> mx.array:
        """Reconstructed vectors in the rotated basis, float32 ``(rows, dim)``."""
        codes = [unpack_bits(chunks.value(), bits, width) for chunks, bits, width
                 in zip(self.angles, self.level_bits, self.tables.level_widths(), strict=True)]
        return self.tables.rotated_points(codes, self.radii.value())


def level_bits_for(bits: int) -> tuple[int, ...]:
    """Level 1 at ``bits``, levels 2-4 at ``max(1, bits - 2)`` (4 -> the paper's 4/2/2/2)."""
    return (bits,) + (max(1, bits - 2),) * (LEVELS - 1)


class PolarPoolCodec:
    """PolarQuant as a format of the batched pool: each vector coded alone.

    Per head and token a block holds every level's packed angle codes (uint8,
    level 1 first) and the float16 radius of each 16-coordinate block, and
    decodes to the original basis, as the pool's attention reads keys and
    values. Same seed, same codes as :class:`PolarQuantCache`.
    """

    def __init__(self, dim: int, bits: int = 4, seed: int = 0) -> None:
        if dim % BLOCK:
            raise ValueError(f"polar transforms blocks of {BLOCK} coordinates; head_dim {dim} "
                             f"is not a multiple of {BLOCK}")
        self.tables = PolarTables(dim, level_bits_for(bits), seed)
        self.bits = bits
        self._row_bytes = self.tables.level_bytes()

    @property
    def code_width(self) -> int:
        return sum(self._row_bytes)

    @property
    def param_width(self) -> int:
        return self.tables.blocks

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``x`` (``..., dim``) as ``(uint8 codes, float16 radii)`` with the same lead."""
        lead = x.shape[:-1]
        codes_per_level, radii = self.tables.angle_codes(
            x.astype(mx.float32).reshape(-1, self.tables.dim))
        packed = [pack_bits(c, b) for c, b in zip(codes_per_level, self.tables.level_bits,
                                                  strict=True)]
        codes = mx.concatenate(packed, axis=-1)
        return codes.reshape(*lead, self.code_width), radii.reshape(*lead, self.param_width)

    def decode(self, codes: mx.array, params: mx.array, dtype: mx.Dtype) -> mx.array:
        """Turn :meth:`encode`'s output (any lead) back into ``dtype`` values."""
        lead, t = codes.shape[:-1], self.tables
        flat = codes.reshape(-1, self.code_width)
        parts, start = [], 0
        for width, bits, size in zip(t.level_widths(), t.level_bits, self._row_bytes,
                                     strict=True):
            parts.append(unpack_bits(flat[:, start:start + size], bits, width))
            start += size
        points = t.rotated_points(parts, params.reshape(-1, self.param_width))
        return (points @ t.rotation).astype(dtype).reshape(*lead, t.dim)


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
        self.level_bits = level_bits_for(self.bits)
        tables = self.tables = PolarTables(self.head_dim, self.level_bits, config.seed)
        self.rotation = tables.rotation
        self._keys = PolarStream(tables)
        self._values = PolarStream(tables)

    @property
    def format(self) -> str:
        return f"polar{self.bits}"

    def bits_per_coordinate(self) -> float:
        """Angle bits plus the float16 block radius, per coordinate."""
        angle_bits = sum((BLOCK >> (lv + 1)) * b for lv, b in enumerate(self.level_bits))
        return (angle_bits + 16) / BLOCK

    def expected_memory_bytes(self) -> int:
        """Closed form: packed angle rows per level plus float16 radii."""
        per_row = self.tables.blocks * 2 + sum(self.tables.level_bytes())
        return (self.n_keys + self.n_values) * per_row

    def _append_keys(self, keys: mx.array) -> None:
        self._keys.encode(keys)
        mx.eval(self._keys.radii.value(), *(a.value() for a in self._keys.angles))

    def _append_values(self, values: mx.array) -> None:
        self._values.encode(values)
        mx.eval(self._values.radii.value(), *(a.value() for a in self._values.angles))
