"""How the KV arena stores keys and values: the model's dtype, or affine 8/4-bit codes.

A format decides the bytes one token of one head costs in the pool, and how
a layer's gathered blocks turn back into the compute dtype for attention::

    native   D values in the compute dtype                      D x dtype bytes
    q8       D uint8 codes, then per group of `group_size`       D + 3 x D / group_size
             values a uint8 zero point and a float16 scale:
             value = (code - zero) x scale
    q4       D 4-bit codes, two a byte (low nibble first), and   D / 2 + 4 x D / group_size
             per group a float16 scale and bias:
             value = code x scale + bias   (mx.quantize's affine scheme)
    turboquant_mse                                             D / 2 + 2
             the unit vector rotated by a seeded orthogonal R, each
             coordinate a 4-bit Lloyd-Max code, and a float16 norm:
             value = norm x centroid[code] @ R
    polar    PolarQuant's 4/2/2/2 angle codes of each block of    D x 23 / 64 + D / 8
             16 rotated coordinates and a float16 radius a block

q8 and q4 are affine; they differ in how the bias is kept. q8 widens each group's
range to hold 0 so its bias is an integer zero point (one byte, not two): at
head_dim 64 a token of one head costs 67 bytes, 1.91x fewer than float16
(68 bytes, 1.88x, with a float16 bias). q4 keeps a float16 bias: a 4-bit
range widened to hold 0 would lose up to half of its 16 levels in a group of
one sign, for one byte in 36. Scales are
float16 whatever the compute dtype: float32 ones would cost a 4-bit token of
head_dim 64 40 bytes instead of 36 (3.2x instead of 3.6x fewer than float16).

The last two are compression methods of ``veloxquant_mlx.cache`` (TurboQuant,
PolarQuant) that code each vector alone, so a block is final once written and
a batch can read it: their pool codecs (``TurboQuantPoolCodec``,
``PolarPoolCodec``) share the per-request caches' constants and code a vector
the same way. They decode to the original basis, which costs a D x D matmul
per gathered vector where q8/q4 pay a multiply-add.

Codes are plain bytes rather than mx.quantize's uint32 words, so decoding is
a cast and one multiply-add: on this CPU a layer's gather plus decode took
0.6-1.3 ms against 9-10 ms through ``mx.dequantize`` with float16 scales (16
rows of 128 tokens, SmolLM2's shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import mlx.core as mx

from veloxquant_mlx.cache.polar import PolarPoolCodec
from veloxquant_mlx.cache.turboquant import TurboQuantPoolCodec
from veloxquant_mlx.exceptions import KVFormatError
from veloxquant_mlx.memory.pool_config import pool_format_problem

KV_FORMATS: dict[str, int | None] = {"native": None, "q8": 8, "q4": 4,
                                     "turboquant_mse": 4, "polar": 4}
"""Format name -> bits per stored number (None: the compute dtype)."""


class VectorCodec(Protocol):
    """A compression method's face to the pool: one head's vectors in, codes out."""

    code_width: int
    param_width: int

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]: ...

    def decode(self, codes: mx.array, params: mx.array, dtype: mx.Dtype) -> mx.array: ...


_METHOD_CODECS = {"turboquant_mse": (TurboQuantPoolCodec, "tq"), "polar": (PolarPoolCodec, "polar")}
"""The pool formats that are compression methods: their codec and tag prefix."""


@lru_cache(maxsize=16)
def method_codec(name: str, head_dim: int) -> VectorCodec:
    """The codec of method format ``name`` at ``head_dim`` (one per process: its
    rotation and codebook are built once and shared by every layer)."""
    codec, _ = _METHOD_CODECS[name]
    return codec(head_dim, KV_FORMATS[name])

GROUP_SIZES = (32, 64, 128)
"""Group sizes ``mx.quantize`` accepts."""

_DTYPE_TAG = {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One storage format for the pool's keys and values.

    Args:
        name: ``"native"``, ``"q8"``, ``"q4"``, ``"turboquant_mse"`` or ``"polar"``.
        group_size: Values sharing one scale and bias (q8 and q4; the
            compression methods code whole vectors and ignore it).

    Raises:
        KVFormatError: Unknown name or unsupported group size.
    """

    name: str = "native"
    group_size: int = 64

    def __post_init__(self) -> None:
        problem = pool_format_problem(self.name)
        if problem is not None:
            raise KVFormatError(problem)
        if self.group_size not in GROUP_SIZES:
            raise KVFormatError(f"KV group_size {self.group_size} is not supported; choose "
                                f"one of {', '.join(map(str, GROUP_SIZES))}")

    @property
    def bits(self) -> int | None:
        """Bits per stored number; None for the native format."""
        return KV_FORMATS[self.name]

    @property
    def quantized(self) -> bool:
        """Whether blocks hold codes rather than compute-dtype values."""
        return self.bits is not None

    def tag(self, dtype: mx.Dtype) -> str:
        """The block ``format`` tag: ``"fp32"`` (native float32), ``"q8g64"``, ``"q4g32"``...

        It names everything needed to read a block back, so two blocks with
        equal tags hold interchangeable bytes (prefix caching hashes it).
        """
        if not self.quantized:
            return _DTYPE_TAG.get(dtype, str(dtype).removeprefix("mlx.core."))
        if self.name in _METHOD_CODECS:
            return f"{_METHOD_CODECS[self.name][1]}{self.bits}"
        return f"{self.name}g{self.group_size}"

    def codec(self, head_dim: int) -> VectorCodec | None:
        """The compression method's codec at ``head_dim``; None for native, q8 and q4."""
        return method_codec(self.name, head_dim) if self.name in _METHOD_CODECS else None

    def check(self, head_dim: int) -> None:
        """Refuse a head_dim the groups do not divide.

        Raises:
            KVFormatError: ``head_dim`` is not a multiple of ``group_size``, or
                not a shape the compression method codes.
        """
        if self.name in _METHOD_CODECS:
            try:
                self.codec(head_dim)
            except ValueError as exc:
                raise KVFormatError(f"KV format {self.name}: {exc}") from None
            return
        if self.quantized and head_dim % self.group_size:
            fits = [g for g in GROUP_SIZES if head_dim % g == 0]
            raise KVFormatError(f"KV format {self.name} with group_size {self.group_size} "
                                f"cannot split head_dim {head_dim}; use a group_size of "
                                f"{' or '.join(map(str, fits)) or 'none (use native)'}")

    def code_width(self, head_dim: int) -> int:
        """uint8 entries per head and token: the codes (q8: then one zero point a group)."""
        codec = self.codec(head_dim)
        if codec is not None:
            return codec.code_width
        if self.bits == 8:
            return head_dim + head_dim // self.group_size
        return head_dim * (self.bits or 0) // 8

    def param_width(self, head_dim: int) -> int:
        """float16 entries per head and token: q8 a scale a group, q4 scales then biases."""
        codec = self.codec(head_dim)
        if codec is not None:
            return codec.param_width
        groups = head_dim // self.group_size
        return groups if self.bits == 8 else 2 * groups

    def vector_bytes(self, head_dim: int, dtype: mx.Dtype) -> int:
        """Stored bytes of one head's keys (or values) for one token."""
        if not self.quantized:
            return head_dim * dtype.size
        return self.code_width(head_dim) + 2 * self.param_width(head_dim)

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Quantize ``x`` (``..., head_dim``) into ``(uint8 codes, float16 params)``.

        The scale (and q4's bias) is rounded to float16 *before* the codes are
        computed, so the codes are the nearest ones for the numbers decoding
        will read; the scale is rounded up so that the group's range still
        fits the top code.
        """
        codec = self.codec(x.shape[-1])
        if codec is not None:
            return codec.encode(x)
        levels = (1 << self.bits) - 1
        lead, dim = x.shape[:-1], x.shape[-1]
        groups = x.astype(mx.float32).reshape(*lead, dim // self.group_size, self.group_size)
        low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
        if self.bits == 8:
            # The range is widened to hold 0, so that the bias is -zero x scale
            # with an integer zero point: one byte instead of a float16.
            low, high = mx.minimum(low, 0.0), mx.maximum(high, 0.0)
            scale = _half_up(mx.maximum((high - low) / levels, 1e-6))
            zero = mx.clip(mx.round(-low / scale), 0, levels)
            codes = mx.clip(mx.round(groups / scale) + zero, 0, levels).astype(mx.uint8)
            codes = mx.concatenate([codes.reshape(*lead, dim),
                                    zero[..., 0].astype(mx.uint8)], axis=-1)
            return codes, scale[..., 0].astype(mx.float16)
        bias = low.astype(mx.float16).astype(mx.float32)
        scale = _half_up(mx.maximum((high - bias) / levels, 1e-6))
        codes = mx.clip(mx.round((groups - bias) / scale), 0, levels).astype(mx.uint8)
        codes = codes.reshape(*lead, dim)
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the even code in the low nibble
        params = mx.concatenate([scale[..., 0], bias[..., 0]], axis=-1)
        return codes, params.astype(mx.float16)

    def decode(self, codes: mx.array, params: mx.array, dtype: mx.Dtype,
               head_dim: int | None = None) -> mx.array:
        """Turn ``encode``'s output (any leading shape) back into ``dtype`` values.

        ``head_dim`` is needed by the compression methods' formats only.
        """
        if self.name in _METHOD_CODECS:
            if head_dim is None:
                raise KVFormatError(f"decoding KV format {self.name} needs the head_dim")
            return method_codec(self.name, head_dim).decode(codes, params, dtype)
        lead, g = params.shape[:-1], self.group_size
        if self.bits == 8:
            groups = params.shape[-1]
            scale = params.astype(dtype)[..., None]
            zero = codes[..., groups * g:].astype(dtype)[..., None]
            values = codes[..., : groups * g].reshape(*lead, groups, g).astype(dtype)
            return ((values - zero) * scale).reshape(*lead, groups * g)
        groups = params.shape[-1] // 2
        codes = mx.stack([codes & 15, codes >> 4], axis=-1)
        values = codes.reshape(*lead, groups, g).astype(dtype)
        params = params.astype(dtype)[..., None]
        out = values * params[..., :groups, :] + params[..., groups:, :]
        return out.reshape(*lead, groups * g)


def _half_up(scale: mx.array) -> mx.array:
    """``scale`` as the float16 just above it (read back in float32).

    float16 rounding moves a number by at most 2^-11 of it, so scaling up by
    2^-10 first guarantees a result that is not smaller.
    """
    return (scale * (1 + 2.0**-10)).astype(mx.float16).astype(mx.float32)


NATIVE = KVFormat()
"""The default format: keys and values as the model computes them."""
