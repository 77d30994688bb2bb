"""QJL (Zandieh et al., 2024): 1-bit quantized Johnson-Lindenstrauss keys.

A key ``k`` is stored as ``sign(S k)`` (``m`` bits, ``S`` an ``m x d`` Gaussian)
plus ``||k||`` in float16. The asymmetric estimator

    <q, k>  ~=  sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>

is unbiased: for a Gaussian row ``s``, ``E[<s,q> sign(<s,k>)] =
sqrt(2/pi) <q,k> / ||k||``. The query is projected once per attend, never
quantized. ``m = bits * head_dim`` so keys cost ``bits`` bits per coordinate
(plus 16 bits per token for the norm). Values are quantized per token in
groups of ``group_size`` channels at ``max(bits, 2)`` bits, as in the paper;
a 1-bit min/max value code would keep only the two extremes of each group.
"""

from __future__ import annotations

import math

import mlx.core as mx

from veloxquant_mlx.cache.base import ChunkList, KVCache
from veloxquant_mlx.cache.packing import pack_bits, packed_row_bytes, unpack_bits
from veloxquant_mlx.cache.projections import random_gaussian
from veloxquant_mlx.cache.uniform import GroupCodes, dequantize_groups, quantize_groups


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
        return None

    def __init__(self, config) -> None:
        super().__init__(config)
        self.sketch_dim = self.bits * self.head_dim
        self.sketch = random_gaussian(self.sketch_dim, self.head_dim, config.seed)
        self.group = config.group_size
        self.value_bits = max(self.bits, 2)
        self._signs, self._norms = ChunkList(), ChunkList()
        self._v_codes, self._v_scale, self._v_min = ChunkList(), ChunkList(), ChunkList()

    @property
    def format(self) -> str:
        return f"qjl{self.bits}"

    @property
    def n_keys(self) -> int:
        return self._signs.rows

    @property
    def n_values(self) -> int:
        return self._v_codes.rows

    def memory_bytes(self) -> int:
        parts = (self._signs, self._norms, self._v_codes, self._v_scale, self._v_min)
        return sum(p.nbytes for p in parts)

    def expected_memory_bytes(self) -> int:
        """Closed form: m sign bits + float16 norm per key; codes + scales per value."""
        d = self.head_dim
        keys = self.n_keys * (packed_row_bytes(self.sketch_dim, 1) + 2)
        per_value = packed_row_bytes(d, self.value_bits) + (d // self.group) * 4
        values = self.n_values * per_value
        return keys + values

    def _append_keys(self, keys: mx.array) -> None:
        self._signs.append(pack_bits(keys @ self.sketch.T >= 0, 1))
        self._norms.append(mx.sqrt((keys * keys).sum(axis=-1)).astype(mx.float16))
        mx.eval(self._signs.value(), self._norms.value())

    def _append_values(self, values: mx.array) -> None:
        q = quantize_groups(values, self.value_bits, self.group)
        self._v_codes.append(q.packed)
        self._v_scale.append(q.scale)
        self._v_min.append(q.minimum)
        mx.eval(self._v_codes.value(), self._v_scale.value(), self._v_min.value())

    def _scaled_signs(self) -> mx.array:
        signs = unpack_bits(self._signs.value(), 1, self.sketch_dim).astype(mx.float32) * 2 - 1
        scale = math.sqrt(math.pi / 2) / self.sketch_dim
        return signs * (scale * self._norms.value().astype(mx.float32))[:, None]

    def key_scores(self, queries: mx.array) -> mx.array:
        return (queries @ self.sketch.T) @ self._scaled_signs().T

    def decode_keys(self) -> mx.array:
        """Unbiased reconstruction ``sqrt(pi/2)/m * ||k|| * S^T sign(S k)`` (noisy per key)."""
        return self._scaled_signs() @ self.sketch

    def decode_values(self) -> mx.array:
        codes = GroupCodes(self._v_codes.value(), self._v_scale.value(), self._v_min.value())
        return dequantize_groups(codes, self.value_bits, self.group, self.head_dim)
