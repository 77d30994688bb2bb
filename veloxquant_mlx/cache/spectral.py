"""Spectral (low-rank) KV compression: a per-head SVD basis + quantized coefficients.

Keys (and values) of one head concentrate in a low-dimensional subspace. The
first ``calibration_tokens`` rows of each stream are buffered in float16; when
the buffer is full, the stream fits its basis from them:

    mean  mu = mean(X)                    (float16, d)
    X - mu = U S W^T                      (thin SVD)
    rank r = config.rank, or the smallest r keeping ``energy`` of sum(S^2)
    basis B = W[:, :r]                    (float16, d x r)
    scale s_j = S_j / sqrt(C)             (float16, r; std of coefficient j)

and every row (the buffered ones included) is stored as whitened coefficients
``((x - mu) B) / s`` quantized per token with one float16 min/scale at
``bits`` bits. Decoding is ``mu + (c * s) B^T``. The energy outside the basis is
dropped: ``rank``/``energy`` trade memory for accuracy. Basis, mean and scales
are data-dependent, so ``memory_bytes`` counts them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache.base import ChunkList, TwoStreamCache
from veloxquant_mlx.cache.packing import packed_row_bytes
from veloxquant_mlx.cache.uniform import GroupCodes, dequantize_groups, quantize_groups


class SpectralStream:
    """One stream: a float16 calibration buffer, then basis + coefficient codes."""

    def __init__(self, dim: int, bits: int, config) -> None:
        self.dim, self.bits = dim, bits
        self.calibration = config.calibration_tokens
        self.fixed_rank, self.energy = config.rank, config.energy
        self.buffer = ChunkList()
        self.codes, self.scale, self.minimum = ChunkList(), ChunkList(), ChunkList()
        self.mean = self.basis = self.coef_scale = None
        self.rank = 0

    @property
    def rows(self) -> int:
        return self.buffer.rows + self.codes.rows

    @property
    def nbytes(self) -> int:
        fitted = sum(a.nbytes for a in (self.mean, self.basis, self.coef_scale) if a is not None)
        return fitted + sum(p.nbytes for p in (self.buffer, self.codes, self.scale, self.minimum))

    def append(self, x: mx.array) -> None:
        if self.basis is None:
            self.buffer.append(x.astype(mx.float16))
            if self.buffer.rows >= self.calibration:
                rows = self.buffer.value().astype(mx.float32)
                self.buffer.replace(None)
                self._fit(rows[: self.calibration])
                self._encode(rows)
        else:
            self._encode(x)
        arrays = [p.value() for p in (self.buffer, self.codes, self.scale, self.minimum) if p.rows]
        mx.eval(*arrays)

    def _fit(self, rows: mx.array) -> None:
        data = np.array(rows, dtype=np.float64)
        mean = data.mean(axis=0)
        _, sing, vt = np.linalg.svd(data - mean, full_matrices=False)
        energy = sing**2
        if self.fixed_rank is not None:
            rank = min(self.fixed_rank, sing.size)
        else:
            kept = np.cumsum(energy) / max(energy.sum(), 1e-30)
            rank = int(np.searchsorted(kept, self.energy - 1e-12) + 1)
        rank = max(1, min(rank, sing.size))
        # A zero singular value would make whitening divide by zero; floor it.
        std = np.maximum(sing[:rank] / np.sqrt(rows.shape[0]), 1e-3)
        self.rank = rank
        self.mean = mx.array(mean.astype(np.float16))
        self.basis = mx.array(vt[:rank].T.astype(np.float16))
        self.coef_scale = mx.array(std.astype(np.float16))

    def _encode(self, x: mx.array) -> None:
        coefs = (x - self.mean.astype(mx.float32)) @ self.basis.astype(mx.float32)
        q = quantize_groups(coefs / self.coef_scale.astype(mx.float32), self.bits, self.rank)
        self.codes.append(q.packed)
        self.scale.append(q.scale)
        self.minimum.append(q.minimum)

    def coefficients(self) -> mx.array:
        """Decoded (un-whitened) coefficients ``(rows, rank)``; needs a fitted basis."""
        codes = GroupCodes(self.codes.value(), self.scale.value(), self.minimum.value())
        coefs = dequantize_groups(codes, self.bits, self.rank, self.rank)
        return coefs * self.coef_scale.astype(mx.float32)

    def decode(self) -> mx.array:
        if self.basis is None:
            return self.buffer.value().astype(mx.float32)
        return self.mean.astype(mx.float32) + self.coefficients() @ self.basis.astype(mx.float32).T

    def expected_nbytes(self) -> int:
        if self.basis is None:
            return self.buffer.rows * self.dim * 2
        fitted = (self.dim + self.dim * self.rank + self.rank) * 2
        return fitted + self.codes.rows * (packed_row_bytes(self.rank, self.bits) + 4)


class SpectralCache(TwoStreamCache):
    """Low-rank spectral cache; ``format`` is ``"svd{bits}"``."""

    method = "spectral"
    bits_range = (2, 8)
    default_bits = 4

    def __init__(self, config) -> None:
        super().__init__(config)
        self._keys = SpectralStream(self.head_dim, self.bits, config)
        self._values = SpectralStream(self.head_dim, self.bits, config)

    @property
    def format(self) -> str:
        return f"svd{self.bits}"

    @property
    def key_rank(self) -> int:
        """Rank of the key basis (0 until calibrated)."""
        return self._keys.rank

    @property
    def value_rank(self) -> int:
        """Rank of the value basis (0 until calibrated)."""
        return self._values.rank

    def expected_memory_bytes(self) -> int:
        """Closed form: basis/mean/scales + packed coefficients + per-token min/scale."""
        return self._keys.expected_nbytes() + self._values.expected_nbytes()

    def _append_keys(self, keys: mx.array) -> None:
        self._keys.append(keys)

    def _append_values(self, values: mx.array) -> None:
        self._values.append(values)

    # In the coefficient domain attention costs O(n * rank) instead of O(n * d):
    # q.k = q.mu + (q B).c  and  p @ V = rowsum(p) mu + (p @ C) B^T.
    def key_scores(self, queries: mx.array) -> mx.array:
        keys = self._keys
        if keys.basis is None:
            return super().key_scores(queries)
        mean, basis = keys.mean.astype(mx.float32), keys.basis.astype(mx.float32)
        return (queries @ mean)[:, None] + (queries @ basis) @ keys.coefficients().T

    def combine_values(self, probs: mx.array) -> mx.array:
        values = self._values
        if values.basis is None:
            return super().combine_values(probs)
        mean, basis = values.mean.astype(mx.float32), values.basis.astype(mx.float32)
        return probs.sum(axis=-1, keepdims=True) * mean + (probs @ values.coefficients()) @ basis.T

    def decode_keys(self) -> mx.array:
        return self._keys.decode()

    def decode_values(self) -> mx.array:
        return self._values.decode()
