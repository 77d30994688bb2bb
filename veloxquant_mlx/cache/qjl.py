"""QJL (Zandieh et al., 2024): 1-bit quantized Johnson-Lindenstrauss keys.

A key ``k`` is stored as ``sign(S k)`` (``m`` bits, ``S`` an ``m x d`` Gaussian)
plus ``||k||`` in float16. The asymmetric estimator

    <q, k>  ~=  sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>

is unbiased: for a Gaussian row ``s``, ``E[<s,q> sign(<s,k>)] =
sqrt(2/pi) <q,k> / ||k||``. The query is projected, never quantized.
``m = bits * head_dim``, so keys cost ``bits`` bits per coordinate.

Outliers, as in the paper's kernel: the estimator's variance grows with
``||q|| ||k||``, and a few key channels carry most of the norm. Keys are
therefore taken in groups of ``group_size`` tokens (the newest, incomplete
group stays float16); in each group the ``outlier_channels`` channels of
largest norm are split off and sketched separately (``m/2`` bits, own norm).
Each part's estimate is restricted to its own channels, which keeps it
unbiased and pairs the big outlier norms with only the query's few outlier
coordinates::

    group g (G tokens):  idx_g = top-o channels by norm over the group
    k = k_in + k_out      k_out = k on idx_g, k_in = k elsewhere
    <q,k> ~ est(q_in, k_in; S, m) + est(q_out, k_out; S_o, m/2)

Values are quantized per token in groups of ``group_size`` channels at
``max(bits, 2)`` bits (a 1-bit min/max code keeps only each group's extremes).
"""

from __future__ import annotations

import math

import mlx.core as mx

from veloxquant_mlx.cache.base import ChunkList, KVCache
from veloxquant_mlx.cache.packing import pack_bits, packed_row_bytes, unpack_bits
from veloxquant_mlx.cache.projections import random_gaussian
from veloxquant_mlx.cache.uniform import GroupCodes, dequantize_groups, quantize_groups


class QJLKeys:
    """Sketched key groups (inlier + outlier parts) and the float16 tail group."""

    def __init__(self, dim: int, sketch_dim: int, outliers: int, group: int, seed: int) -> None:
        self.dim, self.m, self.o = dim, sketch_dim, outliers
        self.m_out = max(8, sketch_dim // 2)
        # Without outliers there is nothing to choose per group: sketch at once.
        self.group = group if outliers else 1
        self.sketch = random_gaussian(sketch_dim, dim, seed, stream=0)
        self.sketch_out = random_gaussian(self.m_out, dim, seed, stream=1)
        self.signs, self.norms = ChunkList(), ChunkList()
        self.out_signs, self.out_norms, self.indices = ChunkList(), ChunkList(), ChunkList()
        self.tail = ChunkList()
        self.index_dtype = mx.uint8 if dim <= 256 else mx.uint16

    @property
    def rows(self) -> int:
        return self.signs.rows + self.tail.rows

    @property
    def nbytes(self) -> int:
        parts = (self.signs, self.norms, self.out_signs, self.out_norms, self.indices, self.tail)
        return sum(p.nbytes for p in parts)

    def expected_nbytes(self) -> int:
        n_q = self.signs.rows
        per_key = packed_row_bytes(self.m, 1) + 2
        if self.o:
            per_key += packed_row_bytes(self.m_out, 1) + 2
        index_bytes = (n_q // self.group) * self.o * (1 if self.dim <= 256 else 2)
        return n_q * per_key + index_bytes + self.tail.rows * self.dim * 2

    def append(self, keys: mx.array) -> None:
        self.tail.append(keys.astype(mx.float16))
        if self.tail.rows >= self.group:
            tail = self.tail.value()
            full = (tail.shape[0] // self.group) * self.group
            self._sketch(tail[:full].astype(mx.float32))
            self.tail.replace(tail[full:])
        parts = (self.signs, self.norms, self.out_signs, self.out_norms, self.indices, self.tail)
        mx.eval(*(p.value() for p in parts if p.rows))

    def _sketch(self, keys: mx.array) -> None:
        inliers = keys
        if self.o:
            n_groups = keys.shape[0] // self.group
            grouped = keys.reshape(n_groups, self.group, self.dim)
            channel_norms = mx.sqrt((grouped * grouped).sum(axis=1))  # (groups, d)
            idx = mx.argsort(-channel_norms, axis=-1)[:, : self.o]
            mask = self._outlier_mask(idx).reshape(n_groups, 1, self.dim)
            outliers = (grouped * mask).reshape(keys.shape)
            inliers = keys - outliers
            self.indices.append(idx.astype(self.index_dtype))
            self.out_signs.append(pack_bits(outliers @ self.sketch_out.T >= 0, 1))
            self.out_norms.append(mx.sqrt((outliers * outliers).sum(axis=-1)).astype(mx.float16))
        self.signs.append(pack_bits(inliers @ self.sketch.T >= 0, 1))
        self.norms.append(mx.sqrt((inliers * inliers).sum(axis=-1)).astype(mx.float16))

    def _outlier_mask(self, idx: mx.array) -> mx.array:
        """(groups, d) float mask with 1 on each group's outlier channels."""
        hits = idx.astype(mx.int32)[..., None] == mx.arange(self.dim)
        return hits.any(axis=1).astype(mx.float32)

    @staticmethod
    def _scaled(signs: ChunkList, norms: ChunkList, m: int) -> mx.array:
        """``sqrt(pi/2)/m * ||k|| * sign(S k)`` rows, float32 ``(n, m)``."""
        s = unpack_bits(signs.value(), 1, m).astype(mx.float32) * 2 - 1
        return s * (math.sqrt(math.pi / 2) / m * norms.value().astype(mx.float32))[:, None]

    def scores(self, queries: mx.array) -> mx.array:
        """Estimated ``queries @ K^T``, ``(q, rows)``."""
        parts = []
        if self.signs.rows:
            parts.append(self._sketched_scores(queries))
        if self.tail.rows:
            parts.append(queries @ self.tail.value().astype(mx.float32).T)
        return mx.concatenate(parts, axis=1)

    def _sketched_scores(self, queries: mx.array) -> mx.array:
        inlier = self._scaled(self.signs, self.norms, self.m)
        projected = queries @ self.sketch.T  # (q, m), shared by every group
        if not self.o:
            return projected @ inlier.T
        n_q, g = self.signs.rows, self.group
        idx = self.indices.value().astype(mx.uint32)  # (groups, o)
        q_out = queries[:, idx]  # (q, groups, o): the query on each group's outliers
        # S applied to the query's outlier part, per group; the inlier sketch is the rest.
        proj_out_in = mx.einsum("qgo,gom->qgm", q_out, self.sketch.T[idx])
        proj_out = mx.einsum("qgo,gom->qgm", q_out, self.sketch_out.T[idx])
        outlier = self._scaled(self.out_signs, self.out_norms, self.m_out)
        s_in = mx.einsum("qgm,gtm->qgt", projected[:, None, :] - proj_out_in,
                         inlier.reshape(n_q // g, g, self.m))
        s_out = mx.einsum("qgm,gtm->qgt", proj_out, outlier.reshape(n_q // g, g, self.m_out))
        return (s_in + s_out).reshape(queries.shape[0], n_q)

    def decode(self) -> mx.array:
        """Unbiased (noisy) key reconstructions, float32 ``(rows, d)``."""
        parts = []
        if self.signs.rows:
            inlier = self._scaled(self.signs, self.norms, self.m) @ self.sketch
            if self.o:
                g = self.group
                mask = mx.repeat(self._outlier_mask(self.indices.value()), g, axis=0)
                outlier = self._scaled(self.out_signs, self.out_norms, self.m_out) @ self.sketch_out
                inlier = inlier * (1 - mask) + outlier * mask
            parts.append(inlier)
        if self.tail.rows:
            parts.append(self.tail.value().astype(mx.float32))
        return mx.concatenate(parts, axis=0)


class QJLCache(KVCache):
    """QJL keys + per-token quantized values; ``format`` is ``"qjl{bits}"``."""

    method = "qjl"
    bits_range = (1, 8)
    default_bits = 2

    @classmethod
    def head_dim_error(cls, config) -> str | None:
        if config.head_dim % config.group_size:
            return (
                f"qjl quantizes values in groups of group_size={config.group_size} channels; "
                "use a head_dim that is a multiple of group_size or change group_size"
            )
        if config.outlier_channels >= config.head_dim:
            return f"outlier_channels={config.outlier_channels} must be below head_dim"
        return None

    def __init__(self, config) -> None:
        super().__init__(config)
        self.sketch_dim = self.bits * self.head_dim
        self.group = config.group_size
        self.value_bits = max(self.bits, 2)
        self._keys = QJLKeys(self.head_dim, self.sketch_dim, config.outlier_channels,
                             config.group_size, config.seed)
        self._v_codes, self._v_scale, self._v_min = ChunkList(), ChunkList(), ChunkList()

    @property
    def format(self) -> str:
        return f"qjl{self.bits}"

    @property
    def n_keys(self) -> int:
        return self._keys.rows

    @property
    def n_values(self) -> int:
        return self._v_codes.rows

    @property
    def n_sketched_keys(self) -> int:
        """Keys already sketched (the rest wait, float16, for their group to fill)."""
        return self._keys.signs.rows

    def memory_bytes(self) -> int:
        values = (self._v_codes, self._v_scale, self._v_min)
        return self._keys.nbytes + sum(p.nbytes for p in values)

    def expected_memory_bytes(self) -> int:
        """Closed form: sign bits, float16 norms, outlier indices, tail; value codes + scales."""
        d = self.head_dim
        per_value = packed_row_bytes(d, self.value_bits) + (d // self.group) * 4
        return self._keys.expected_nbytes() + self.n_values * per_value

    def _append_keys(self, keys: mx.array) -> None:
        self._keys.append(keys)

    def _append_values(self, values: mx.array) -> None:
        q = quantize_groups(values, self.value_bits, self.group)
        self._v_codes.append(q.packed)
        self._v_scale.append(q.scale)
        self._v_min.append(q.minimum)
        mx.eval(self._v_codes.value(), self._v_scale.value(), self._v_min.value())

    def key_scores(self, queries: mx.array) -> mx.array:
        return self._keys.scores(queries)

    def decode_keys(self) -> mx.array:
        """Unbiased reconstruction from the sketches (noisy per key); tail keys exact."""
        return self._keys.decode()

    def decode_values(self) -> mx.array:
        codes = GroupCodes(self._v_codes.value(), self._v_scale.value(), self._v_min.value())
        return dequantize_groups(codes, self.value_bits, self.group, self.head_dim)
