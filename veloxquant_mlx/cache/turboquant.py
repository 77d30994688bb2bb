"""TurboQuant (Zandieh et al., 2025): rotation + Lloyd-Max scalar codebooks.

``turboquant_mse``: store each vector's norm (float16) apart, rotate the unit
vector by a seeded Haar-random orthogonal matrix ``R`` so every coordinate
follows the known sphere-coordinate density, and quantize each coordinate
with that density's ``b``-bit Lloyd-Max codebook. For unit vectors at
head_dim 128 the expected squared error is ~0.36, 0.117, 0.034, 0.0093 at
1-4 bits (the paper's 0.36/0.117/0.03/0.009).

``turboquant_prod``: the MSE quantizer is biased for inner products (at 1 bit
it shrinks them by 2/pi). The inner-product variant spends ``b-1`` bits on the
MSE stage and 1 bit on QJL of the residual ``r``: ``sign(S r)`` with a Gaussian
``S`` plus ``||r||``, decoded as ``sqrt(pi/2)/d * ||r|| * S^T sign(S r)``, which
makes ``<q, k_hat>`` an unbiased estimate of ``<q, k>``. Values, which only
need low MSE, use the ``b``-bit MSE quantizer in both variants.

Attention runs in the rotated domain: scores are ``(q R^T) . y_hat`` and the
value mix ``p @ y_hat_v`` is rotated back once per query, never per token.
"""

from __future__ import annotations

import math

import mlx.core as mx

from veloxquant_mlx.cache.base import ChunkList, RotatedTwoStreamCache
from veloxquant_mlx.cache.codebooks import sphere_coordinate_codebook
from veloxquant_mlx.cache.packing import pack_bits, packed_row_bytes, unpack_bits
from veloxquant_mlx.cache.projections import random_gaussian, random_orthogonal

_TINY = 1e-12


def sphere_codebook(dim: int, bits: int) -> tuple[mx.array, mx.array]:
    """The ``bits``-bit Lloyd-Max centroids and boundaries of one coordinate of a
    random unit vector in ``R^dim``, as float32 arrays."""
    book = sphere_coordinate_codebook(dim, bits)
    return (mx.array(book.centroids.astype("float32")),
            mx.array(book.boundaries.astype("float32")))


def sphere_codes(x: mx.array, rotation: mx.array,
                 boundaries: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Code the rows of ``x`` (``n, dim``): ``(codes, norms, y)``, where ``y`` is the
    rotated unit vector whose coordinates the codes quantize."""
    norms = mx.sqrt((x * x).sum(axis=-1))
    y = (x / mx.maximum(norms, _TINY)[:, None]) @ rotation.T
    return (y[..., None] > boundaries).sum(axis=-1), norms, y


class RotatedStream:
    """One stream (keys or values) of rotated Lloyd-Max codes plus norms."""

    def __init__(self, rotation: mx.array, bits: int) -> None:
        self.rotation = rotation
        self.dim = rotation.shape[0]
        self.bits = bits
        self.centroids, self.boundaries = sphere_codebook(self.dim, bits)
        self.codes = ChunkList()
        self.norms = ChunkList()

    @property
    def rows(self) -> int:
        return self.codes.rows

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.norms.nbytes

    def encode(self, x: mx.array) -> mx.array:
        """Store ``x``; return the rotated unit-norm residual ``y - c[idx]``."""
        idx, norms, y = sphere_codes(x, self.rotation, self.boundaries)
        self.codes.append(pack_bits(idx, self.bits))
        self.norms.append(norms.astype(mx.float16))
        return y - self.centroids[idx]

    def decode_rotated(self) -> mx.array:
        """``norm * centroids[idx]`` in the rotated domain, ``(rows, dim)`` float32."""
        idx = unpack_bits(self.codes.value(), self.bits, self.dim).astype(mx.uint32)
        return self.centroids[idx] * self.stored_norms()[:, None]

    def stored_norms(self) -> mx.array:
        return self.norms.value().astype(mx.float32)


class TurboQuantMSECache(RotatedTwoStreamCache):
    """TurboQuant-MSE for keys and values; ``format`` is ``"tq{bits}"``."""

    method = "turboquant_mse"
    bits_range = (1, 8)
    default_bits = 4

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rotation = random_orthogonal(self.head_dim, config.seed)
        self._keys = RotatedStream(self.rotation, self._key_mse_bits())
        self._values = RotatedStream(self.rotation, self.bits)

    def _key_mse_bits(self) -> int:
        return self.bits

    @property
    def format(self) -> str:
        return f"tq{self.bits}"

    def expected_memory_bytes(self) -> int:
        """Closed form: packed codes plus one float16 norm per row."""
        d = self.head_dim
        return (self.n_keys + self.n_values) * (packed_row_bytes(d, self.bits) + 2)

    def _append_keys(self, keys: mx.array) -> None:
        self._keys.encode(keys)
        mx.eval(self._keys.codes.value(), self._keys.norms.value())

    def _append_values(self, values: mx.array) -> None:
        self._values.encode(values)
        mx.eval(self._values.codes.value(), self._values.norms.value())



class TurboQuantProdCache(TurboQuantMSECache):
    """TurboQuant-prod: unbiased key inner products; ``format`` is ``"tqp{bits}"``.

    Keys cost ``bits - 1`` bits (MSE stage) + 1 bit (QJL signs) per coordinate
    plus two float16 scalars (norm, residual norm) per token.
    """

    method = "turboquant_prod"
    bits_range = (2, 8)
    default_bits = 4

    def __init__(self, config) -> None:
        super().__init__(config)
        self.sketch = random_gaussian(self.head_dim, self.head_dim, config.seed)
        self._signs = ChunkList()
        self._res_norms = ChunkList()

    def _key_mse_bits(self) -> int:
        return self.bits - 1

    @property
    def format(self) -> str:
        return f"tqp{self.bits}"

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self._signs.nbytes + self._res_norms.nbytes

    def expected_memory_bytes(self) -> int:
        d = self.head_dim
        keys = self.n_keys * (packed_row_bytes(d, self.bits - 1) + packed_row_bytes(d, 1) + 4)
        return keys + self.n_values * (packed_row_bytes(d, self.bits) + 2)

    def _append_keys(self, keys: mx.array) -> None:
        residual = self._keys.encode(keys)
        self._signs.append(pack_bits(residual @ self.sketch.T >= 0, 1))
        self._res_norms.append(mx.sqrt((residual * residual).sum(axis=-1)).astype(mx.float16))
        mx.eval(self._keys.codes.value(), self._keys.norms.value(),
                self._signs.value(), self._res_norms.value())

    def _qjl_rotated(self) -> mx.array:
        """Per-token QJL residual estimate in the rotated domain, scaled by the key norm."""
        signs = unpack_bits(self._signs.value(), 1, self.head_dim).astype(mx.float32) * 2 - 1
        scale = math.sqrt(math.pi / 2) / self.head_dim
        gamma = self._res_norms.value().astype(mx.float32) * self._keys.stored_norms()
        return (signs @ self.sketch) * (scale * gamma)[:, None]

    def _rotated_keys(self) -> mx.array:
        return self._keys.decode_rotated() + self._qjl_rotated()


class TurboQuantPoolCodec:
    """turboquant_mse as a format of the batched pool: each vector coded alone.

    Per head and token a block holds the packed ``bits``-bit codes of the
    rotated unit vector (uint8) and its float16 norm, and decodes to the
    original basis, as the pool's attention reads keys and values. Same seed,
    same codes as :class:`TurboQuantMSECache`.
    """

    def __init__(self, dim: int, bits: int = 4, seed: int = 0) -> None:
        if dim < 3:
            raise ValueError(f"turboquant_mse needs head_dim >= 3, got {dim}")
        self.dim, self.bits = dim, bits
        self.rotation = random_orthogonal(dim, seed)
        self.centroids, self.boundaries = sphere_codebook(dim, bits)

    @property
    def code_width(self) -> int:
        return packed_row_bytes(self.dim, self.bits)

    @property
    def param_width(self) -> int:
        return 1

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``x`` (``..., dim``) as ``(uint8 codes, float16 norms)`` with the same lead."""
        lead = x.shape[:-1]
        idx, norms, _ = sphere_codes(x.astype(mx.float32).reshape(-1, self.dim),
                                     self.rotation, self.boundaries)
        codes = pack_bits(idx, self.bits).reshape(*lead, self.code_width)
        return codes, norms.astype(mx.float16).reshape(*lead, 1)

    def decode(self, codes: mx.array, params: mx.array, dtype: mx.Dtype) -> mx.array:
        """Turn :meth:`encode`'s output (any lead) back into ``dtype`` values."""
        lead = codes.shape[:-1]
        idx = unpack_bits(codes.reshape(-1, self.code_width), self.bits, self.dim)
        y = self.centroids[idx.astype(mx.uint32)] * params.reshape(-1, 1).astype(mx.float32)
        return (y @ self.rotation).astype(dtype).reshape(*lead, self.dim)
