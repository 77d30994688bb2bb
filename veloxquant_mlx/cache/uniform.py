"""Asymmetric (min/scale) uniform quantization over groups of a row.

Used where a method's paper calls for plain integer quantization with a
per-group zero point and scale: KIVI's keys (per channel) and values (per
token), QJL's values, and the spectral method's coefficients. Scale and
minimum are stored in float16, and codes are computed against the float16
copies so decoding reproduces exactly what the encoder assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from veloxquant_mlx.cache.packing import pack_bits, unpack_bits

# A group whose values are all equal has range 0; any positive scale then
# decodes it exactly, and this one stays representable in float16.
_MIN_SCALE = 1e-4


@dataclass(slots=True)
class GroupCodes:
    """Packed result of :func:`quantize_groups` for ``n`` rows.

    Attributes:
        packed: ``uint8`` bit-packed codes, shape ``(n, packed bytes)``.
        scale: float16 step per group, shape ``(n, groups)``.
        minimum: float16 zero point (group minimum), shape ``(n, groups)``.
    """

    packed: mx.array
    scale: mx.array
    minimum: mx.array


def quantize_groups(x: mx.array, bits: int, group: int) -> GroupCodes:
    """Quantize each row of ``x`` in consecutive groups of ``group`` columns.

    Args:
        x: Float array of shape ``(n, c)``; ``c`` must be a multiple of ``group``.
        bits: Bits per code (1..8).
        group: Columns sharing one scale and minimum.

    Returns:
        The packed codes with their float16 scales and minima.
    """
    n, c = x.shape
    g = x.astype(mx.float32).reshape(n, c // group, group)
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    levels = 2**bits - 1
    lo16 = lo.astype(mx.float16)
    scale16 = mx.maximum((hi - lo16.astype(mx.float32)) / levels, _MIN_SCALE).astype(mx.float16)
    codes = mx.round((g - lo16[..., None]) / scale16[..., None])
    codes = mx.clip(codes, 0, levels).astype(mx.uint8).reshape(n, c)
    return GroupCodes(pack_bits(codes, bits), scale16, lo16)


def dequantize_groups(codes: GroupCodes, bits: int, group: int, n_cols: int) -> mx.array:
    """Decode :class:`GroupCodes` back to float32 of shape ``(n, n_cols)``."""
    n = codes.packed.shape[0]
    q = unpack_bits(codes.packed, bits, n_cols).astype(mx.float32)
    q = q.reshape(n, n_cols // group, group)
    scale = codes.scale.astype(mx.float32)[..., None]
    out = q * scale + codes.minimum.astype(mx.float32)[..., None]
    return out.reshape(n, n_cols)
