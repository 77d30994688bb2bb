"""Which BLAS serves MLX's ``cblas_sgemm`` in this process, and the start-up line naming it.

Reads what the dynamic linker resolved (``dladdr`` on the global ``cblas_sgemm``, then
``/proc/self/maps`` for MLX's bundled copy), so it reports what
:func:`~veloxquant_mlx.cpu_backend.load_optimized_blas` did without loading anything.
Only :func:`describe_backend` imports MLX, and only when called.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from veloxquant_mlx.blas_finder import (
    FORWARD_STEM,
    OPT_OUT_ENV,
    WHEEL_MODULE,
    WHEEL_PREFIX,
    find_sgemv_forward,
    preload_opted_out,
    wheel_blas,
)
from veloxquant_mlx.mlx_device import describe_device, mlx_build


@dataclass(frozen=True, slots=True)
class ActiveBlas:
    """The BLAS that MLX's ``cblas_sgemm`` calls resolve to in this process.

    Attributes:
        path: The BLAS library serving ``cblas_sgemm`` (behind the forward when that is in
            front), or None when none is loaded yet.
        loaded: True when it comes from the global scope
            (:func:`~veloxquant_mlx.cpu_backend.load_optimized_blas`), i.e. it overrides the
            copy bundled with MLX.
        config: OpenBLAS's ``openblas_get_config()`` string when available.
        threads: OpenBLAS's thread count when available.
        forward: The forward library in front of it, when there is one.
        routes: Whether the forward serves one-row products and quantized codes itself
            (False under ``VELOXQUANT_NO_SGEMV_FORWARD``: it only passes calls on).
    """

    path: Path | None
    loaded: bool
    config: str | None = None
    threads: int | None = None
    forward: Path | None = None
    routes: bool = False


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def forward_calls() -> int | None:
    """How many ``cblas_sgemm`` calls reached the forward in this process (None: absent)."""
    handle = ctypes.CDLL(None)
    if not hasattr(handle, "vq_blas_calls"):
        return None
    handle.vq_blas_calls.restype = ctypes.c_long
    return int(handle.vq_blas_calls())


def active_blas() -> ActiveBlas:
    """Report which BLAS serves ``cblas_sgemm`` to MLX in this process (Linux).

    Returns:
        The loaded library when one provides ``cblas_sgemm`` globally (named behind the
        forward when that is in front); otherwise the bundled one if MLX is loaded (path
        None before that).
    """
    if sys.platform != "linux":
        return ActiveBlas(path=None, loaded=False)
    serving = _global_symbol_path("cblas_sgemm")
    if serving is None:
        return ActiveBlas(path=_mapped_bundled_blas(), loaded=False)
    handle = ctypes.CDLL(None)
    forward, routes = None, False
    if serving.name.startswith(FORWARD_STEM) and hasattr(handle, "vq_blas_bound"):
        handle.vq_blas_bound.restype = ctypes.c_void_p
        forward, routes = serving, bool(handle.vq_forward_routes())
        serving = _address_path(handle.vq_blas_bound()) or serving
    config, threads = _openblas_info(serving)
    return ActiveBlas(path=serving, loaded=True, config=config, threads=threads,
                      forward=forward, routes=routes)


def _global_symbol_path(name: str) -> Path | None:
    """Path of the object that provides ``name`` in the global scope, if any."""
    handle = ctypes.CDLL(None)
    try:
        func = getattr(handle, name)
    except AttributeError:
        return None
    return _address_path(ctypes.cast(func, ctypes.c_void_p).value)


def _address_path(address: int | None) -> Path | None:
    """Path of the loaded object holding ``address``, if any."""
    if not address:
        return None
    info = _DlInfo()
    if not ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return None
    return Path(os.fsdecode(info.dli_fname)) if info.dli_fname else None


def _mapped_bundled_blas() -> Path | None:
    """The BLAS mapped into this process from MLX's wheel (``mlx_cpu.libs``), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                name = line.rsplit(maxsplit=1)[-1]
                if "mlx_cpu.libs" in name and "/libblas" in name:
                    return Path(name)
    except OSError:
        pass
    return None


def _openblas_info(path: Path) -> tuple[str | None, int | None]:
    """OpenBLAS's configuration string and thread count, from the loaded ``path``."""
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None, None
    config = threads = None
    for prefix in (WHEEL_PREFIX, ""):
        if hasattr(lib, f"{prefix}openblas_get_config"):
            get_config = getattr(lib, f"{prefix}openblas_get_config")
            get_config.restype = ctypes.c_char_p
            config = get_config().decode(errors="replace").strip()
            threads = int(getattr(lib, f"{prefix}openblas_get_num_threads")())
            break
    return config, threads


def describe_backend(dtype: str | None = None) -> str:
    """One start-up log line: MLX version, the device, the BLAS behind a CPU and the dtype.

    Imports ``mlx.core``, so call it after
    :func:`~veloxquant_mlx.cpu_backend.load_optimized_blas`.

    Args:
        dtype: The compute dtype of the loaded model, if known (e.g. ``"float32"``).

    Returns:
        For example ``"MLX 0.32.4 on gpu (CUDA: NVIDIA H200, 140 GiB); dtype bfloat16"``, or
        ``"MLX 0.32.4 on cpu (AMD EPYC); BLAS: optimized (loaded
        .../scipy_openblas32/lib/libscipy_openblas.so; OpenBLAS 0.3.34 ..., 2 threads;
        one-row products as sgemv); dtype float32"``.
    """
    import mlx.core as mx

    device = mx.default_device()
    parts = [f"MLX {mx.__version__} on {describe_device(mx, device)}"]
    if device.type != mx.DeviceType.gpu:
        parts.append(_describe_cpu_blas())
        shadowed = mlx_build().shadowed
        if shadowed:
            # pip wrote mlx-cpu's libmlx.so over the CUDA one (see mlx_device's docstring).
            parts.append(f"{shadowed} is installed but mlx-cpu's libmlx.so replaced its own; "
                         f"for the GPU run: pip install --force-reinstall --no-deps "
                         f"{shadowed}=={mx.__version__}")
    if dtype:
        parts.append(f"dtype {dtype}")
    return "; ".join(parts)


def _prompt_kernels() -> bool:
    """Whether the forward also serves prompt attention and SwiGLU (AVX2)."""
    from veloxquant_mlx import native_swiglu
    from veloxquant_mlx.memory import native_attention

    return native_attention.kernel() is not None and native_swiglu.kernel() is not None


def _describe_cpu_blas() -> str:
    """Which BLAS serves MLX's CPU float32 matmuls, with the fix when it is the slow one."""
    if sys.platform == "darwin":
        return "BLAS: Accelerate"
    blas = active_blas()
    if not blas.loaded:
        return f"BLAS: MLX's bundled reference BLAS ({blas.path}); {_bundled_hint()}"
    extra = [s for s in (blas.config, f"{blas.threads} threads" if blas.threads else "") if s]
    if blas.routes:
        extra.append("one-row products as sgemv")
        if _prompt_kernels():
            extra.append("prompt attention and SwiGLU in C")
    return f"BLAS: optimized (loaded {'; '.join([str(blas.path), *extra])})"


def _bundled_hint() -> str:
    """What would put MLX on an optimized BLAS here."""
    if preload_opted_out(True):
        return f"{OPT_OUT_ENV} is set"
    if wheel_blas() is None:
        return f"pip install {WHEEL_MODULE.replace('_', '-')} for ~30x faster float32 matmuls"
    if find_sgemv_forward() is None:
        return ("the BLAS forward (veloxquant_mlx/sgemv_forward.c) is not built: reinstall "
                "with a C compiler for ~30x faster float32 matmuls")
    return "installed but not loaded here: turned off, or see the warning before this line"
