"""Run MLX's Linux CPU backend on an optimized BLAS, and name the device MLX computes on.

MLX's Linux CPU wheel links a bundled *reference* BLAS (``mlx_cpu.libs/libblas-*.so.3``).
Its float32 matmuls (``cblas_sgemm``, the only BLAS entry MLX calls for float32) run at a
few GFLOP/s; the same call into OpenBLAS runs ~30x faster. float16/bfloat16 matmuls do not
go through BLAS at all, so they gain nothing.

``libmlx.so`` is loaded by Python with ``RTLD_LOCAL``, so its ``cblas_sgemm`` resolves from
the global scope first (the main program and every library loaded with ``RTLD_GLOBAL``
before it) and from its own bundled dependency only when nothing global provides the
symbol. :func:`load_optimized_blas` therefore loads, in this process and before anything
imports MLX::

    1. the BLAS, privately: the ``scipy-openblas32`` wheel's OpenBLAS (a dependency on
       Linux; no root needed), else a distribution's OpenBLAS (scripts/install_blas.sh)
    2. veloxquant_mlx/_sgemv_forward*.so, handed the BLAS's sgemm and sgemv by address
       (vq_blas_bind), then made global: MLX's ``cblas_sgemm`` lands in it
    3. the BLAS made global too (a distribution's also serves MLX's cblas_dgemm/cgemm)

The forward (``setup.py`` builds it from ``sgemv_forward.c``) is what makes the wheel
usable at all: the wheel exports its BLAS as ``scipy_cblas_sgemm``, a name MLX never asks
for. In front of either BLAS it also serves the one-row products of single-stream decode
with ``sgemv`` (which reads the weights about twice as fast as sgemm does for one row).
Without the forward
(no compiler at install time) only a distribution's OpenBLAS, which exports the plain
names, can serve MLX.

Before loading a candidate in this process, a child process loads it the same way and
checks a few sgemms: a library built for another CPU dies there (SIGILL), not in the
server. Any failure leaves MLX on its bundled BLAS and logs one warning line.

On a GPU nothing is loaded: matmuls run on cuBLAS or Metal there. macOS means Metal; on
Linux, MLX's CUDA build is recognised without importing MLX
(:func:`veloxquant_mlx.mlx_device.mlx_build`).

Process-level environment variables (the only environment this module and
:mod:`~veloxquant_mlx.blas_finder` read; they govern the process, not server configuration):

* ``VELOXQUANT_NO_BLAS_PRELOAD=1`` -- load no optimized BLAS (same as ``enabled=False``).
* ``VELOXQUANT_BLAS_LIBRARY=PATH`` -- try this OpenBLAS only, instead of the wheel's and then
  a distribution's (e.g. Debian's ``openblas-pthread/libblas.so.3``); a
  ``libscipy_openblas*`` file is taken to have the wheel's prefixed names.
* ``VELOXQUANT_NO_SGEMV_FORWARD=1`` -- the forward only passes calls on to the BLAS: no
  one-row sgemv, no products from quantized codes, no prompt kernels (for measuring what
  they buy).
* ``OPENBLAS_THREAD_TIMEOUT`` -- set to 4 before OpenBLAS loads (it reads it then) unless
  already set. OpenBLAS's idle worker threads otherwise busy-wait for 2**28 cycles
  (~0.1 s) after every call; between the many small matmuls of a decode step they steal
  the core MLX needs (on 2 cores, decode ran ~15-50% slower with the default).

Finding the candidates is :mod:`veloxquant_mlx.blas_finder`'s job, and saying which BLAS
serves MLX once loaded (:func:`~veloxquant_mlx.blas_status.active_blas`, the start-up line
:func:`~veloxquant_mlx.blas_status.describe_backend`) :mod:`veloxquant_mlx.blas_status`'s;
like this module, neither imports MLX on import.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from veloxquant_mlx.blas_finder import (
    OPT_OUT_ENV,
    BlasLibrary,
    blas_candidates,
    find_sgemv_forward,
    preload_opted_out,
)
from veloxquant_mlx.blas_status import ActiveBlas, active_blas
from veloxquant_mlx.mlx_device import gpu_expected

log = logging.getLogger(__name__)

FORWARD_OPT_OUT_ENV = "VELOXQUANT_NO_SGEMV_FORWARD"
# log2 of the cycles an idle OpenBLAS thread spins before sleeping (OpenBLAS's minimum).
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
THREAD_TIMEOUT = "4"
# First lines of a child Python that runs MLX on the optimized BLAS, as the server does
# (``child_env`` decides whether it loads anything).
LOAD_FIRST = "from veloxquant_mlx.cpu_backend import load_optimized_blas\nload_optimized_blas()\n"

# Runs in the probe child: loads a candidate as the parent would, then checks it (see
# _probe_child). ``-I -S`` keeps user site-packages and PYTHONPATH out of the probe.
_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from veloxquant_mlx.cpu_backend import _probe_child
sys.exit(_probe_child(sys.argv[2:]))
"""


def _forward_routes() -> bool:
    """False when ``VELOXQUANT_NO_SGEMV_FORWARD`` asks the forward only to pass calls on."""
    return os.environ.get(FORWARD_OPT_OUT_ENV, "") in ("", "0")


def load_optimized_blas(enabled: bool = True,
                        candidates: Sequence[BlasLibrary] | None = None) -> ActiveBlas | None:
    """Load an optimized BLAS under MLX in this process (Linux, MLX's CPU build).

    Call it before anything imports ``mlx``: MLX binds ``cblas_sgemm`` when it loads, so a
    BLAS loaded later is never called. Loading is in place (no restart); a second call
    reports what the first loaded.

    Nothing is loaded when: not Linux (macOS uses Accelerate/Metal), ``enabled`` is False,
    ``VELOXQUANT_NO_BLAS_PRELOAD=1``, MLX's CUDA build is installed (the GPU does the
    matmuls; :func:`~veloxquant_mlx.mlx_device.mlx_build`), or no candidate is installed.
    A candidate that fails to load or compute is skipped with one warning line; MLX then
    keeps its bundled BLAS.

    Args:
        enabled: The ``cpu.optimized_blas`` setting.
        candidates: The libraries to try, best first; by default
            :func:`~veloxquant_mlx.blas_finder.blas_candidates`.

    Returns:
        What serves MLX's float32 matmuls now, or None when nothing was loaded.
    """
    if sys.platform != "linux" or preload_opted_out(enabled) or gpu_expected():
        return None
    current = active_blas()
    if current.loaded:
        return current
    forward = find_sgemv_forward()
    if candidates is None:
        candidates = blas_candidates(forward is not None)
    if not candidates:
        return None
    if "mlx.core" in sys.modules:
        log.warning("optimized BLAS not loaded: MLX is already imported, and it binds its "
                    "BLAS when it loads; MLX uses its bundled reference BLAS")
        return None
    os.environ.setdefault(THREAD_TIMEOUT_ENV, THREAD_TIMEOUT)
    routes = _forward_routes()
    problems = []
    for lib in candidates:
        problem = probe_blas(lib, forward, routes) or _load(lib, forward, routes)
        if problem is None:
            if problems:
                log.warning("optimized BLAS: skipped %s; loaded %s", "; ".join(problems),
                            lib.path)
            return active_blas()
        problems.append(problem if str(lib.path) in problem else f"{lib.path}: {problem}")
    log.warning("optimized BLAS not loaded (%s); MLX uses its bundled reference BLAS",
                "; ".join(problems))
    return None


def _load(lib: BlasLibrary, forward: Path | None, routes: bool) -> str | None:
    """Load ``lib`` behind ``forward`` into the global scope; the problem, or None.

    Nothing becomes global until the forward is bound, so a failure part-way leaves no
    unbound ``cblas_sgemm`` for MLX to find.
    """
    try:
        blas = ctypes.CDLL(str(lib.path), mode=os.RTLD_LOCAL)
        sgemm = getattr(blas, lib.symbol("cblas_sgemm"))
        sgemv = getattr(blas, lib.symbol("cblas_sgemv"))
        if forward is not None:
            front = ctypes.CDLL(str(forward), mode=os.RTLD_LOCAL)
            front.vq_blas_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            addresses = (ctypes.cast(f, ctypes.c_void_p) for f in (sgemm, sgemv))
            if front.vq_blas_bind(*addresses, int(routes)) != 0:
                return "the forward refused its sgemm/sgemv"
            # Reopening with RTLD_GLOBAL makes a loaded library global, in this order:
            # the forward's cblas_sgemm must come before a distribution BLAS's own.
            ctypes.CDLL(str(forward), mode=os.RTLD_GLOBAL)
        elif lib.prefix:
            return "its names are prefixed and the forward that serves them is not built"
        ctypes.CDLL(str(lib.path), mode=os.RTLD_GLOBAL)
    except (OSError, AttributeError) as exc:
        return str(exc)
    return None


def probe_blas(lib: BlasLibrary, forward: Path | None, routes: bool = True,
               timeout: float = 30.0) -> str | None:
    """Check, in a child process, that ``lib`` (behind ``forward``) loads and computes.

    Args:
        lib: The candidate library.
        forward: The forward to put in front of it, if any.
        routes: Whether the forward serves one-row products itself.
        timeout: Seconds to wait for the child.

    Returns:
        None when the child loaded it and got the right products; else what went wrong.
    """
    package_parent = str(Path(__file__).resolve().parents[1])
    args = [str(lib.path), lib.prefix, str(forward or ""), "1" if routes else "0"]
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE, package_parent, *args],
            capture_output=True, text=True, timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired:
        return f"its check took over {timeout:.0f} s"
    except OSError as exc:
        return f"its check did not start: {exc}"
    if done.returncode == 0:
        return None
    last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
    if done.returncode < 0:
        last = [f"its check died with signal {-done.returncode}"]
    return last[0]


def _probe_child(argv: list[str]) -> int:
    """The probe child's work: load as the parent would, then check sgemms (exit status)."""
    path, prefix, forward, routes = argv
    problem = _load(BlasLibrary(Path(path), prefix), Path(forward) if forward else None,
                    routes == "1")
    problem = problem or _check_sgemm()
    if problem:
        print(problem, file=sys.stderr)
        return 3
    return 0


def _check_sgemm() -> str | None:
    """A 64x64 sgemm and one-row products (both ways round) through the global
    ``cblas_sgemm``, as MLX will call it; the problem, or None."""
    handle = ctypes.CDLL(None)
    try:
        sgemm = handle.cblas_sgemm
    except AttributeError:
        return "no cblas_sgemm in the global scope after loading"
    n = 64
    ones = (ctypes.c_float * (n * n))(*([1.0] * (n * n)))
    for m, trans_b in ((n, 111), (1, 111), (1, 112)):
        out = (ctypes.c_float * (n * n))(*([float("nan")] * (n * n)))
        sgemm(101, 111, trans_b, m, n, n, ctypes.c_float(1.0), ones, n, ones, n,
              ctypes.c_float(0.0), out, n)
        if any(v != n for v in out[: m * n]):
            return f"wrong sgemm products (m={m})"
    return None


def child_env(preload: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """Build an environment for a child Python that runs MLX with or without the BLAS.

    The child loads the BLAS itself: ``python -m server`` does, and other child code
    starts with :data:`LOAD_FIRST`.

    Args:
        preload: True to let the child load the optimized BLAS; False to opt it out.
        base: The environment to start from; defaults to ``os.environ``.

    Returns:
        A fresh dict, ready for ``subprocess.run(..., env=...)``.
    """
    env = dict(os.environ if base is None else base)
    if preload:
        env.pop(OPT_OUT_ENV, None)
    else:
        env[OPT_OUT_ENV] = "1"
    return env


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` that loads the optimized BLAS first, for a program that
    does not load it itself (e.g. ``mlx_lm.server`` as a benchmark's peer).

    Whether it loads follows the child's environment, as for :data:`LOAD_FIRST`.
    """
    run = f"import runpy\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    return [sys.executable, "-c", LOAD_FIRST + run, *args]
