"""RoPE's cosines and sines computed once per decode step, for every layer.

Why: on MLX's CPU backend ``mx.fast.rope`` has no kernel of its own; it is
built from ~14 plain ops (positions, inverse frequencies, ``exp``, ``cos``,
``sin``, casts, the rotation), and a decode step calls it twice per layer. On
SmolLM2 (30 layers) that is ~840 graph nodes a step, at several microseconds
each on this CPU, and all but the rotation depend only on the rows' positions,
which every layer of a step shares. :class:`SharedRope` computes the tables
once per step and each layer only rotates (measured on the CPU: q and k of one
SmolLM2 layer, compiled, 113 -> 55 us).

The tables are computed with the very ops, in the same order, that MLX's own
fallback uses, so the rotated values are bit for bit those of ``mx.fast.rope``
on the CPU (tests/test_shared_rope.py). On a GPU ``mx.fast.rope`` is one
kernel: :func:`shared_rope` returns None there and the layers call it as
before.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class SharedRope:
    """One layer module's rotation, with the tables shared by every call of a step.

    Args:
        dims: Leading feature dimensions rotated (the rest pass through).
        traditional: Rotate consecutive pairs (True) or the two halves (False).
        scale: Positions are multiplied by it.
        inv_freqs: ``(dims / 2,)`` float32 inverse frequencies.
    """

    def __init__(self, dims: int, traditional: bool, scale: float, inv_freqs: mx.array) -> None:
        self.dims, self.traditional = dims, traditional
        self.scale = mx.array(scale, mx.float32)
        self.inv_freqs = inv_freqs
        self._key: tuple | None = None  # (offset array, n) of the tables
        self._tables: tuple[mx.array, mx.array] | None = None

    def tables(self, offset: mx.array, n: int) -> tuple[mx.array, mx.array]:
        """Float32 cosines and sines for ``n`` columns from each row's ``offset``.

        Built again only when the offset array (a step's) or ``n`` changes:
        the layers of one step all get the first call's arrays.
        """
        if self._key is None or self._key[0] is not offset or self._key[1] != n:
            self._key = (offset, n)
            if offset.size > 1:
                offset = offset[:, None, None]
            positions = (mx.arange(n, dtype=mx.float32) + offset) * self.scale
            theta = positions[..., None] * self.inv_freqs
            self._tables = (mx.cos(theta), mx.sin(theta))
        return self._tables

    def rotate(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """``x`` (``rows, heads, n, D``) rotated by the tables of :meth:`tables`."""
        d = self.dims
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)  # as the fallback casts them
        if self.traditional:
            x1, x2 = x[..., 0:d:2], x[..., 1:d:2]
            pairs = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
            out = mx.concatenate([p[..., None] for p in pairs], axis=-1)
            out = out.reshape(*x.shape[:-1], d)
            parts = [out]
        else:
            x1, x2 = x[..., : d // 2], x[..., d // 2:d]
            parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if d < x.shape[-1]:
            parts.append(x[..., d:])
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def _default_inv_freqs(base: float, half: int) -> mx.array:
    # As MLX's fallback: exp(-i * log(base) / half), the factor rounded to float32.
    step = np.float32(np.float32(math.log(base)) / np.float32(half))
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step))


def shared_rope(module: Any) -> SharedRope | None:
    """A :class:`SharedRope` doing what ``module`` does, or None to call ``module``.

    None on a GPU (``mx.fast.rope`` is a kernel there) and for rope modules
    whose call is not plain ``mx.fast.rope`` over base or frequencies (YaRN
    and SuScaled rescale the input first).
    """
    if mx.default_device().type != mx.DeviceType.cpu:
        return None
    half = getattr(module, "dims", 0) // 2
    if type(module) is nn.RoPE:
        inv = _default_inv_freqs(module.base, half)
        return SharedRope(module.dims, module.traditional, module.scale, inv)
    if type(module).__name__ == "Llama3RoPE" and hasattr(module, "_freqs"):
        inv = mx.reciprocal(module._freqs.astype(mx.float32))
        return SharedRope(module.dims, module.traditional, 1.0, inv)
    return None
