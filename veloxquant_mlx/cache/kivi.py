"""KIVI (Liu et al., 2024): tuning-free asymmetric 2-bit KV-cache quantization.

Keys are quantized per channel (each channel of a group of ``group_size``
consecutive tokens shares a zero point and scale), because key outliers live
in fixed channels; values are quantized per token (groups of ``group_size``
channels within a token), because attention mixes values token by token.
The most recent tokens stay in float16:

* keys: a float16 window fills up to ``residual_length`` tokens, then the
  whole window is quantized at once (``residual_length / group_size`` token
  groups) and emptied, so 0..residual_length-1 keys are unquantized;
* values: the newest ``residual_length`` values stay float16 (a sliding
  window); older ones are quantized as they leave it.

Layout of stored key groups (G = group_size)::

    tokens  0..G-1 | G..2G-1 | ... | quantized | fp16 window (< R tokens)
    scale/min: one float16 per (token group, channel)
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.base import ChunkList, KVCache
from veloxquant_mlx.cache.packing import pack_bits, packed_row_bytes, unpack_bits
from veloxquant_mlx.cache.uniform import GroupCodes, dequantize_groups, quantize_groups


class KIVICache(KVCache):
    """KIVI cache; ``format`` is ``"int{bits}"``.

    Invariants: quantized key rows are a multiple of ``group_size``; the value
    float16 window never exceeds ``residual_length`` rows.
    """

    method = "kivi"
    bits_range = (2, 8)
    default_bits = 2

    @classmethod
    def head_dim_error(cls, config) -> str | None:
        if config.head_dim % config.group_size:
            return (
                f"kivi quantizes values in groups of group_size={config.group_size} channels; "
                "use a head_dim that is a multiple of group_size or change group_size"
            )
        return None

    @classmethod
    def knob_error(cls, config) -> str | None:
        if config.residual_length == 0 or config.residual_length % config.group_size:
            return (
                f"residual_length={config.residual_length} must be a positive multiple of "
                f"group_size={config.group_size} (kivi quantizes its float16 window a "
                "whole number of token groups at a time)"
            )
        return None

    def __init__(self, config) -> None:
        super().__init__(config)
        self.group = config.group_size
        self.residual = config.residual_length
        self._k_codes, self._k_scale, self._k_min = ChunkList(), ChunkList(), ChunkList()
        self._k_window = ChunkList()
        self._v_codes, self._v_scale, self._v_min = ChunkList(), ChunkList(), ChunkList()
        self._v_window = ChunkList()

    @property
    def format(self) -> str:
        return f"int{self.bits}"

    @property
    def n_keys(self) -> int:
        return self._k_codes.rows + self._k_window.rows

    @property
    def n_values(self) -> int:
        return self._v_codes.rows + self._v_window.rows

    @property
    def n_quantized_keys(self) -> int:
        """Key rows already quantized (the rest sit in the float16 window)."""
        return self._k_codes.rows

    @property
    def n_quantized_values(self) -> int:
        """Value rows already quantized."""
        return self._v_codes.rows

    def memory_bytes(self) -> int:
        parts = (self._k_codes, self._k_scale, self._k_min, self._k_window,
                 self._v_codes, self._v_scale, self._v_min, self._v_window)
        return sum(p.nbytes for p in parts)

    def expected_memory_bytes(self) -> int:
        """Closed-form size from the token counts (the tests compare both)."""
        d, g, b = self.head_dim, self.group, self.bits
        nk, nv = self.n_quantized_keys, self.n_quantized_values
        keys = nk * packed_row_bytes(d, b) + (nk // g) * d * 2 * 2
        values = nv * packed_row_bytes(d, b) + nv * (d // g) * 2 * 2
        windows = (self.n_keys - nk + self.n_values - nv) * d * 2
        return keys + values + windows

    def _append_keys(self, keys: mx.array) -> None:
        self._k_window.append(keys.astype(mx.float16))
        if self._k_window.rows >= self.residual:
            window = self._k_window.value()
            full = (window.shape[0] // self.residual) * self.residual
            self._quantize_keys(window[:full])
            self._k_window.replace(window[full:])
        # Evaluate now so the lazy graph does not keep the float inputs alive.
        parts = (self._k_codes, self._k_scale, self._k_min, self._k_window)
        mx.eval(*(p.value() for p in parts if p.rows))

    def _quantize_keys(self, block: mx.array) -> None:
        n, d, g = block.shape[0], self.head_dim, self.group
        # Per channel: put each token group's G values of one channel in a row.
        by_channel = block.reshape(n // g, g, d).transpose(0, 2, 1).reshape(-1, g)
        q = quantize_groups(by_channel, self.bits, g)
        codes = unpack_bits(q.packed, self.bits, g).reshape(n // g, d, g).transpose(0, 2, 1)
        self._k_codes.append(pack_bits(codes.reshape(n, d), self.bits))
        self._k_scale.append(q.scale.reshape(n // g, d))
        self._k_min.append(q.minimum.reshape(n // g, d))

    def _append_values(self, values: mx.array) -> None:
        self._v_window.append(values.astype(mx.float16))
        overflow = self._v_window.rows - self.residual
        if overflow > 0:
            window = self._v_window.value()
            q = quantize_groups(window[:overflow], self.bits, self.group)
            self._v_codes.append(q.packed)
            self._v_scale.append(q.scale)
            self._v_min.append(q.minimum)
            self._v_window.replace(window[overflow:])
        parts = (self._v_codes, self._v_scale, self._v_min, self._v_window)
        mx.eval(*(p.value() for p in parts if p.rows))

    def decode_keys(self) -> mx.array:
        parts = []
        if self._k_codes.rows:
            n, d, g = self._k_codes.rows, self.head_dim, self.group
            codes = unpack_bits(self._k_codes.value(), self.bits, d).astype(mx.float32)
            codes = codes.reshape(n // g, g, d)
            scale = self._k_scale.value().astype(mx.float32)[:, None, :]
            low = self._k_min.value().astype(mx.float32)[:, None, :]
            parts.append((codes * scale + low).reshape(n, d))
        if self._k_window.rows:
            parts.append(self._k_window.value().astype(mx.float32))
        return mx.concatenate(parts, axis=0) if parts else mx.zeros((0, self.head_dim))

    def decode_values(self) -> mx.array:
        parts = []
        if self._v_codes.rows:
            codes = GroupCodes(self._v_codes.value(), self._v_scale.value(), self._v_min.value())
            parts.append(dequantize_groups(codes, self.bits, self.group, self.head_dim))
        if self._v_window.rows:
            parts.append(self._v_window.value().astype(mx.float32))
        return mx.concatenate(parts, axis=0) if parts else mx.zeros((0, self.head_dim))
