"""A prompt chunk's attention in C (``veloxquant_mlx/prefill_attention.c``), on the CPU.

:mod:`~veloxquant_mlx.memory.paged_attention` hands this module the calls of many
query columns (prefill chunks): their softmax, run by MLX as one single-threaded op
after another over the whole score block, cost 2-3x the two products around it. The C
kernel keeps the products on OpenBLAS and makes the softmax one vectorised pass a row
over cache-sized tiles. It lives in the library loaded in front of OpenBLAS
(:mod:`veloxquant_mlx.cpu_backend`), so it is there exactly when the fast float32
path is; elsewhere :func:`kernel` is None and MLX's attention serves.

The kernel reads numpy buffers, so a call evaluates the graph up to this layer's
queries, keys and values first (with the GIL released). A prefill chunk is computed
before its logits are read anyway; decode calls (one column) never come here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

# Query columns from which a call goes to the kernel: below, the evaluation it forces
# per layer and its many small BLAS calls cost more than its softmax saves (SmolLM2 on
# 2 cores with the wheel's OpenBLAS, time to a 1-row prompt's first token, kernel vs
# MLX's attention: 64 tokens 491 vs 354 ms, 128: 630 vs 505, 256: 919 vs 991, 512: 1680
# vs 1766), and decode (one column) stays lazy.
MIN_QUERIES = 192
_ERRORS = {-1: "the CPU lacks AVX2 and FMA", -2: "bad shape", -3: "out of memory"}


class NativeAttentionError(RuntimeError):
    """The kernel refused a call (the message says why)."""


@functools.cache
def kernel() -> Any | None:
    """The loaded kernel's entry point, or None when this process lacks it."""
    handle = ctypes.CDLL(None)
    if not hasattr(handle, "vq_attention") or not handle.vq_attention_supported():
        return None
    fn = handle.vq_attention
    ptr, num = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr] * 7 + [num] * 6 + [ctypes.c_float, ptr]
    return fn


def _host(a: mx.array, dtype: Any = np.float32) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a), dtype=dtype)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def causal_attention(queries: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array],
                     masks: Sequence[mx.array | None], scale: float) -> mx.array:
    """Attention of a prompt chunk over its stored part (optional) and its own columns.

    Args:
        queries: ``(B, Hq, L, D)`` float32.
        keys: ``[stored (B, Hkv, S, D),] own (B, Hkv, L, D)``.
        values: Shaped as ``keys``.
        masks: Boolean per part: stored ``(B, 1, 1, S)`` or None (all visible); own
            ``(B, 1, L, L)``, never showing query ``c`` a key after ``c``.
        scale: Applied to the queries.

    Returns:
        ``(B, Hq, L, D)`` float32, as :func:`paged_attention.attention_parts` computes it.

    Raises:
        NativeAttentionError: The kernel refused the call.
    """
    fn = kernel()
    if fn is None:
        raise NativeAttentionError("the attention kernel is not loaded in this process")
    stored = len(keys) == 2
    own_mask = masks[-1]
    arrays = [queries, *keys, *values] + [m for m in masks if m is not None]
    mx.eval(*arrays)  # releases the GIL while the device catches up
    b, hq, n, d = queries.shape
    hkv = keys[-1].shape[1]
    q = _host(queries)
    k2, v2 = _host(keys[-1]), _host(values[-1])
    if own_mask is None:  # no padding: plain causal
        m2 = np.broadcast_to(np.tri(n, dtype=np.uint8), (b, 1, n, n)).copy()
    else:
        m2 = _host(mx.broadcast_to(own_mask, (b, 1, n, n)), np.uint8)
    k1 = v1 = m1 = None
    s1 = 0
    if stored:
        k1, v1 = _host(keys[0]), _host(values[0])
        s1 = k1.shape[2]
        if masks[0] is not None:
            m1 = _host(mx.broadcast_to(masks[0], (b, 1, 1, s1)), np.uint8)
    out = np.empty((b, hq, n, d), np.float32)
    rc = fn(_ptr(q), _ptr(k1), _ptr(v1), _ptr(m1), _ptr(k2), _ptr(v2), _ptr(m2),
            b, hq, hkv, n, s1, d, scale, _ptr(out))
    if rc:
        raise NativeAttentionError(f"vq_attention: {_ERRORS.get(rc, rc)}")
    return mx.array(out)


def try_causal_attention(queries: mx.array, keys: Sequence[mx.array],
                         values: Sequence[mx.array], masks: Sequence[mx.array | None],
                         scale: float) -> mx.array | None:
    """:func:`causal_attention`, or None (after a warning) when the kernel cannot serve.

    The caller then computes the same attention with MLX: a refused call costs
    speed, never the request.
    """
    if kernel() is None:
        return None
    try:
        return causal_attention(queries, keys, values, masks, scale)
    except NativeAttentionError as exc:
        log.warning("prompt attention falls back to MLX for this call: %s", exc)
        return None
