"""A prompt chunk's SwiGLU in C (``veloxquant_mlx/swiglu.c``), on the CPU.

mlx-lm's Llama-family MLPs compute ``down(silu(gate(x)) * up(x))`` with
``mlx_lm.models.activations.swiglu``; MLX's CPU sigmoid costs ~29 ns an element (a
scalar exp), a third of a SmolLM2 prefill chunk. The project's Llama-shaped MLP
(:mod:`veloxquant_mlx.llama_model`) calls :func:`swiglu`, which runs the C kernel for
float32 calls of :data:`MIN_COLUMNS` sequence positions or more on the CPU, when the
kernel is loaded (the library loaded in front of OpenBLAS,
:mod:`veloxquant_mlx.cpu_backend`). Decode calls (one position) and every other call
run mlx-lm's function, so compiled decode and the library's stock paths are untouched.

A kernel call evaluates ``gate`` and ``up`` first (the kernel reads their buffers),
as :mod:`~veloxquant_mlx.memory.native_attention` does for attention. Results match
MLX's within float32 rounding (the exp differs in its last bits).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu as stock_swiglu

# Sequence positions from which a call goes to the kernel (prompt chunks, not decode).
MIN_COLUMNS = 16


@functools.cache
def kernel() -> Any | None:
    """The loaded kernel's entry point, or None when this process lacks it."""
    handle = ctypes.CDLL(None)
    if not hasattr(handle, "vq_swiglu") or not handle.vq_swiglu_supported():
        return None
    fn = handle.vq_swiglu
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long]
    return fn


def kernel_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` of two float32 arrays of one shape, through the kernel.

    Raises:
        RuntimeError: The kernel is not loaded, or refused the call.
    """
    fn = kernel()
    if fn is None:
        raise RuntimeError("the SwiGLU kernel is not loaded in this process")
    mx.eval(gate, up)  # releases the GIL while the device catches up
    g = np.ascontiguousarray(np.asarray(gate), np.float32)
    u = np.ascontiguousarray(np.asarray(up), np.float32)
    out = np.empty_like(g)
    if fn(g.ctypes.data, u.ctypes.data, out.ctypes.data, g.size):
        raise RuntimeError("vq_swiglu: the CPU lacks AVX2 and FMA")
    return mx.array(out)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """A Llama-shaped MLP's ``silu(gate) * up``: the kernel for prompt chunks, else mlx-lm's.

    The kernel takes float32 ``(rows, positions, features)`` calls of
    :data:`MIN_COLUMNS` positions or more on the CPU where it is loaded; decode
    calls (inside compiled functions too) and everything else run mlx-lm's
    ``swiglu``, so their results are its own.
    """
    if (gate.ndim == 3 and gate.shape[1] >= MIN_COLUMNS and gate.shape == up.shape
            and gate.dtype == mx.float32 and up.dtype == mx.float32
            and mx.default_device().type == mx.DeviceType.cpu
            and kernel() is not None):
        return kernel_swiglu(gate, up)
    return stock_swiglu(gate, up)
