"""Run MLX's Linux CPU backend on an optimized BLAS, and name the device MLX computes on.

MLX's Linux CPU wheel links a bundled *reference* BLAS (``mlx_cpu.libs/libblas-*.so.3``).
Its float32 matmuls (``cblas_sgemm``, the only BLAS entry MLX calls for float32) run at a
few GFLOP/s; the same call into OpenBLAS runs ~30x faster. float16/bfloat16 matmuls do not
go through BLAS at all, so they gain nothing.

``libmlx.so`` is loaded by Python with ``RTLD_LOCAL``, so its ``cblas_sgemm`` resolves from
the global scope first (the main program and ``LD_PRELOAD`` objects) and from its own
bundled dependency only when nothing global provides the symbol. ``LD_PRELOAD`` is read
once, by the dynamic loader, at process start; hence :func:`ensure_optimized_blas`
re-executes the current process once with it set::

    python -m server ...                 (bundled BLAS, nothing imported yet)
      └─ ensure_optimized_blas(True)
           └─ os.execve(python -m server ..., LD_PRELOAD=<openblas>:...,
                        VELOXQUANT_BLAS_PRELOADED=<openblas>)
                └─ ensure_optimized_blas(True) -> marker set: no-op, carry on

Ahead of OpenBLAS the preload puts ``veloxquant_mlx/_sgemv_forward*.so`` when the install
built it (``setup.py``; source ``sgemv_forward.c``): it defines ``cblas_sgemm``, serves the
one-row products of single-stream decode with OpenBLAS's ``cblas_sgemv`` (which reads the
weights about twice as fast as sgemm does for one row) and forwards every other call::

    LD_PRELOAD=<veloxquant_mlx/_sgemv_forward...so>:<openblas>

On a GPU the re-exec is skipped: matmuls run on cuBLAS or Metal there, so a preload would
buy nothing and cost a probe and a restart. macOS means Metal; on Linux, MLX's CUDA build
is recognised without importing MLX (:func:`veloxquant_mlx.mlx_device.mlx_build`). MLX
reads no environment variable that moves its default device to the CPU (the CUDA build's
``gpu::is_available()`` is hard-wired true), so there is no MLX override to honour here.

Process-level environment variables (the only environment this module reads; they govern
the process image, not server configuration):

* ``VELOXQUANT_NO_BLAS_PRELOAD=1`` -- never re-exec (same as ``enabled=False``).
* ``VELOXQUANT_NO_SGEMV_FORWARD=1`` -- preload OpenBLAS alone, without the one-row forward
  (for measuring what it buys).
* ``VELOXQUANT_BLAS_PRELOADED`` -- set on the re-executed process; prevents a second re-exec
  even when the preload did not take.
* ``OPENBLAS_THREAD_TIMEOUT`` -- set to 4 on the re-executed process unless already set.
  OpenBLAS's idle worker threads otherwise busy-wait for 2**28 cycles (~0.1 s) after every
  call; between the many small matmuls of a decode step they steal the core MLX needs (on
  2 cores, decode ran ~15-50% slower with the default).
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from veloxquant_mlx.mlx_device import describe_device, gpu_expected, mlx_build

OPT_OUT_ENV = "VELOXQUANT_NO_BLAS_PRELOAD"
FORWARD_OPT_OUT_ENV = "VELOXQUANT_NO_SGEMV_FORWARD"
FORWARD_STEM = "_sgemv_forward"
MARKER_ENV = "VELOXQUANT_BLAS_PRELOADED"
# log2 of the cycles an idle OpenBLAS thread spins before sleeping (OpenBLAS's minimum).
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
THREAD_TIMEOUT = "4"

# Distribution OpenBLAS builds, best first. Debian's ``libblas.so.3`` under
# ``openblas-pthread`` is OpenBLAS exporting the plain BLAS/CBLAS names MLX calls.
_CANDIDATES = (
    "/usr/lib/{triplet}/openblas-pthread/libblas.so.3",
    "/usr/lib/{triplet}/openblas-openmp/libblas.so.3",
    "/usr/lib/{triplet}/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

# Runs in a child with the candidate preloaded: a 64x64 sgemm and one-row products (what
# the sgemv forward serves, both ways round) through the global ``cblas_sgemm``. A library
# built for another CPU dies here (SIGILL), not in the server.
_PROBE = """
import ctypes, sys
g = ctypes.CDLL(None)
n = 64
a = (ctypes.c_float * (n * n))(*([1.0] * (n * n)))
f = g.cblas_sgemm
f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
              ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
ok = True
for m, trans_b in ((n, 111), (1, 111), (1, 112)):
    c = (ctypes.c_float * (n * n))(*([float("nan")] * (n * n)))
    f(101, 111, trans_b, m, n, n, 1.0, a, n, a, n, 0.0, c, n)
    ok = ok and all(v == n for v in c[: m * n])
sys.exit(0 if ok else 3)
"""


@dataclass(frozen=True, slots=True)
class ActiveBlas:
    """The BLAS that MLX's ``cblas_sgemm`` calls resolve to in this process.

    Attributes:
        path: The BLAS library serving ``cblas_sgemm`` (behind the sgemv forward when that
            is preloaded), or None when none is loaded yet.
        preloaded: True when it comes from the global scope (``LD_PRELOAD``), i.e. it
            overrides the copy bundled with MLX.
        config: OpenBLAS's ``openblas_get_config()`` string when available.
        threads: OpenBLAS's thread count when available.
        forward: The preloaded one-row sgemv forward, when it is in front.
    """

    path: Path | None
    preloaded: bool
    config: str | None = None
    threads: int | None = None
    forward: Path | None = None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def find_optimized_blas() -> Path | None:
    """Return the first installed optimized BLAS that MLX could use, without probing it.

    Returns:
        The library path, or None on non-Linux systems or when none is installed
        (``scripts/install_blas.sh`` installs Debian's OpenBLAS).
    """
    if sys.platform != "linux":
        return None
    triplet = f"{platform.machine()}-linux-gnu"
    for pattern in _CANDIDATES:
        path = Path(pattern.format(triplet=triplet))
        if path.exists():
            return path
    return None


def find_sgemv_forward(env: dict[str, str] | None = None) -> Path | None:
    """Return the built one-row sgemv forward (see the module docstring), if any.

    Args:
        env: The environment whose ``VELOXQUANT_NO_SGEMV_FORWARD`` counts; defaults to
            ``os.environ``.

    Returns:
        ``veloxquant_mlx/_sgemv_forward*.so``; None off Linux, when the install did not
        build it, or when the environment opts out.
    """
    env = os.environ if env is None else env
    if sys.platform != "linux" or env.get(FORWARD_OPT_OUT_ENV, "") not in ("", "0"):
        return None
    built = sorted(Path(__file__).resolve().parent.glob(f"{FORWARD_STEM}*.so"))
    return built[0] if built else None


def preload_list(lib: Path, env: dict[str, str] | None = None) -> list[Path]:
    """What to preload for ``lib``: the sgemv forward (when built) first, then ``lib``."""
    forward = find_sgemv_forward(env)
    return [forward, lib] if forward is not None else [lib]


def probe_blas(path: Path, timeout: float = 20.0, forward: Path | None = None) -> bool:
    """Check, in a child process, that ``path`` preloads and computes sgemms correctly.

    Args:
        path: The candidate library.
        timeout: Seconds to wait for the child.
        forward: The sgemv forward to preload in front of ``path``, if any.

    Returns:
        True when the child exited cleanly with the right products.
    """
    preload = f"{forward}:{path}" if forward is not None else str(path)
    env = dict(os.environ, LD_PRELOAD=preload)
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE],
            env=env, capture_output=True, timeout=timeout, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _global_symbol_path(name: str) -> Path | None:
    """Path of the object that provides ``name`` in the global scope, if any."""
    handle = ctypes.CDLL(None)
    try:
        func = getattr(handle, name)
    except AttributeError:
        return None
    info = _DlInfo()
    if not handle.dladdr(ctypes.cast(func, ctypes.c_void_p), ctypes.byref(info)):
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


def active_blas() -> ActiveBlas:
    """Report which BLAS serves ``cblas_sgemm`` to MLX in this process (Linux).

    Returns:
        The preloaded library when one provides ``cblas_sgemm`` globally; otherwise the
        bundled one if MLX is loaded (path None before that).
    """
    if sys.platform != "linux":
        return ActiveBlas(path=None, preloaded=False)
    preloaded = _global_symbol_path("cblas_sgemm")
    if preloaded is None:
        return ActiveBlas(path=_mapped_bundled_blas(), preloaded=False)
    forward = None
    if preloaded.name.startswith(FORWARD_STEM):  # the BLAS is where its sgemv comes from
        forward, preloaded = preloaded, _global_symbol_path("cblas_sgemv") or preloaded
    handle = ctypes.CDLL(None)
    config = threads = None
    if hasattr(handle, "openblas_get_config"):
        handle.openblas_get_config.restype = ctypes.c_char_p
        config = handle.openblas_get_config().decode(errors="replace").strip()
    if hasattr(handle, "openblas_get_num_threads"):
        threads = int(handle.openblas_get_num_threads())
    return ActiveBlas(path=preloaded, preloaded=True, config=config, threads=threads,
                      forward=forward)


def child_env(preload: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """Build an environment for a child Python that runs MLX with or without the preload.

    Args:
        preload: True to preload the optimized BLAS (when one is installed), with a short
            OpenBLAS thread spin unless the caller chose one; False to strip it from
            ``LD_PRELOAD`` and opt the child out of re-executing itself.
        base: The environment to start from; defaults to ``os.environ``.

    Returns:
        A fresh dict, ready for ``subprocess.run(..., env=...)``.
    """
    env = dict(os.environ if base is None else base)
    lib = find_optimized_blas()
    ours = {str(p) for p in preload_list(lib, {})} if lib is not None else set()
    kept = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p not in ours]
    if preload and lib is not None:
        kept[:0] = [str(p) for p in preload_list(lib, env)]
        env[MARKER_ENV] = str(lib)
        env.setdefault(THREAD_TIMEOUT_ENV, THREAD_TIMEOUT)
        env.pop(OPT_OUT_ENV, None)
    else:
        env.pop(MARKER_ENV, None)
        env[OPT_OUT_ENV] = "1"
    if kept:
        env["LD_PRELOAD"] = ":".join(kept)
    else:
        env.pop("LD_PRELOAD", None)
    return env


def _reexec_argv() -> list[str] | None:
    """The command line that restarts this interpreter the way it was started, or None."""
    orig = list(getattr(sys, "orig_argv", []))
    # Interactive or stdin-fed interpreters cannot be replayed faithfully.
    if not sys.executable or len(orig) < 2 or orig[1] == "-":
        return None
    # orig_argv keeps interpreter flags and "-m pkg" (sys.argv[0] would be a file path).
    return [sys.executable] + orig[1:]


def ensure_optimized_blas(enabled: bool = True) -> None:
    """Re-exec this process once with an optimized BLAS preloaded under MLX (Linux only).

    Call it first thing in an entry point, before ``mlx`` is imported and before any
    side effect (sockets, files) that a restart would repeat. On success this function
    does not return: the process image is replaced and starts again from ``main``.

    No-op when: not Linux (macOS uses Accelerate/Metal), ``enabled`` is False,
    ``VELOXQUANT_NO_BLAS_PRELOAD=1``, the marker of a previous re-exec is set, a BLAS is
    already preloaded, MLX's CUDA build is the one installed (the GPU does the matmuls;
    :func:`~veloxquant_mlx.mlx_device.mlx_build`), no optimized BLAS is installed, the
    candidate fails its probe, or the command line cannot be replayed.

    Args:
        enabled: The ``cpu.optimized_blas`` setting.
    """
    if sys.platform != "linux" or not enabled:
        return
    if os.environ.get(OPT_OUT_ENV, "") not in ("", "0") or MARKER_ENV in os.environ:
        return
    if _global_symbol_path("cblas_sgemm") is not None or gpu_expected():
        return
    lib = find_optimized_blas()
    argv = _reexec_argv()
    if lib is None or argv is None:
        return
    env = child_env(preload=True)
    forward = find_sgemv_forward()
    if forward is not None and not probe_blas(lib, forward=forward):
        # OpenBLAS alone may still be fine: never let the forward cost the whole preload.
        env = child_env(preload=True, base=dict(os.environ, **{FORWARD_OPT_OUT_ENV: "1"}))
        forward = None
    if forward is None and not probe_blas(lib):
        return
    # Buffered output would be lost with the old process image.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def describe_backend(dtype: str | None = None) -> str:
    """One start-up log line: MLX version, the device, the BLAS behind a CPU and the dtype.

    Imports ``mlx.core``, so call it after :func:`ensure_optimized_blas`.

    Args:
        dtype: The compute dtype of the loaded model, if known (e.g. ``"float32"``).

    Returns:
        For example ``"MLX 0.32.4 on gpu (CUDA: NVIDIA H200, 140 GiB); dtype bfloat16"``, or
        ``"MLX 0.32.4 on cpu (AMD EPYC); BLAS: optimized (preloaded
        /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3; OpenBLAS 0.3.21 ...,
        2 threads); dtype float32"``.
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
    """Whether the preloaded forward also serves prompt attention and SwiGLU (AVX2)."""
    from veloxquant_mlx import native_swiglu
    from veloxquant_mlx.memory import native_attention

    return native_attention.kernel() is not None and native_swiglu.kernel() is not None


def _describe_cpu_blas() -> str:
    """Which BLAS serves MLX's CPU float32 matmuls, with the fix when it is the slow one."""
    if sys.platform == "darwin":
        return "BLAS: Accelerate"
    blas = active_blas()
    if blas.preloaded:
        extra = "; ".join(
            s for s in (blas.config, f"{blas.threads} threads" if blas.threads else "") if s
        )
        if blas.forward is not None:
            extra = f"{extra}; one-row products as sgemv" if extra else "one-row products as sgemv"
            if _prompt_kernels():
                extra += "; prompt attention and SwiGLU in C"
        return f"BLAS: optimized (preloaded {blas.path}{'; ' + extra if extra else ''})"
    hint = "install libopenblas0-pthread for ~30x faster float32 matmuls"
    return f"BLAS: MLX's bundled reference BLAS ({blas.path}); {hint}"
