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

Process-level environment variables (the only environment this module reads; they govern
the process, not server configuration):

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
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from veloxquant_mlx.mlx_device import describe_device, gpu_expected, mlx_build

log = logging.getLogger(__name__)

OPT_OUT_ENV = "VELOXQUANT_NO_BLAS_PRELOAD"
CHOICE_ENV = "VELOXQUANT_BLAS_LIBRARY"
FORWARD_OPT_OUT_ENV = "VELOXQUANT_NO_SGEMV_FORWARD"
FORWARD_STEM = "_sgemv_forward"
# log2 of the cycles an idle OpenBLAS thread spins before sleeping (OpenBLAS's minimum).
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
THREAD_TIMEOUT = "4"
# The PyPI wheel of OpenBLAS with 32-bit integers, every symbol prefixed with "scipy_".
WHEEL_MODULE = "scipy_openblas32"
WHEEL_PREFIX = "scipy_"
# First lines of a child Python that runs MLX on the optimized BLAS, as the server does
# (``child_env`` decides whether it loads anything).
LOAD_FIRST = "from veloxquant_mlx.cpu_backend import load_optimized_blas\nload_optimized_blas()\n"

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

# Runs in the probe child: loads a candidate as the parent would, then checks it (see
# _probe_child). ``-I -S`` keeps user site-packages and PYTHONPATH out of the probe.
_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from veloxquant_mlx.cpu_backend import _probe_child
sys.exit(_probe_child(sys.argv[2:]))
"""


@dataclass(frozen=True, slots=True)
class BlasLibrary:
    """An optimized BLAS to load under MLX.

    Attributes:
        path: The shared library.
        prefix: What its CBLAS names start with: ``"scipy_"`` for the wheel's, ``""`` for a
            distribution's (``cblas_sgemm``).
    """

    path: Path
    prefix: str = ""

    def symbol(self, name: str) -> str:
        """This library's name for the CBLAS function ``name`` (e.g. ``cblas_sgemm``)."""
        return self.prefix + name


@dataclass(frozen=True, slots=True)
class ActiveBlas:
    """The BLAS that MLX's ``cblas_sgemm`` calls resolve to in this process.

    Attributes:
        path: The BLAS library serving ``cblas_sgemm`` (behind the forward when that is in
            front), or None when none is loaded yet.
        loaded: True when it comes from the global scope (:func:`load_optimized_blas`),
            i.e. it overrides the copy bundled with MLX.
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


def wheel_blas() -> BlasLibrary | None:
    """The ``scipy-openblas32`` wheel's OpenBLAS, found without importing the wheel.

    Importing ``scipy_openblas32`` loads its library as a side effect; this only looks.

    Returns:
        The library, or None when the wheel is not installed (one this user may not read
        is returned: loading it says why it cannot be used).
    """
    try:
        spec = importlib.util.find_spec(WHEEL_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            found = sorted((Path(folder) / "lib").glob("libscipy_openblas*.so*"))
        except OSError:
            continue
        if found:
            return BlasLibrary(found[0], WHEEL_PREFIX)
    return None


def system_blas(patterns: Sequence[str] = _CANDIDATES) -> BlasLibrary | None:
    """The first distribution OpenBLAS there (``scripts/install_blas.sh`` installs one).

    Args:
        patterns: Where to look, best first; ``{triplet}`` is e.g. ``x86_64-linux-gnu``.

    Returns:
        The library, or None when none is installed. One this user may not read (or may
        not even look for) is returned too: loading it then says why it cannot be used.
    """
    triplet = f"{platform.machine()}-linux-gnu"
    for pattern in patterns:
        path = Path(pattern.format(triplet=triplet))
        try:
            if path.is_file():
                return BlasLibrary(path)
        except PermissionError:  # a folder on the way that this user may not search
            return BlasLibrary(path)
    return None


def find_sgemv_forward() -> Path | None:
    """Return the built forward library (see the module docstring), if any.

    Returns:
        ``veloxquant_mlx/_sgemv_forward*.so``; None off Linux or when the install did not
        build it (no C compiler).
    """
    if sys.platform != "linux":
        return None
    built = sorted(Path(__file__).resolve().parent.glob(f"{FORWARD_STEM}*.so"))
    return built[0] if built else None


def blas_candidates(with_forward: bool) -> list[BlasLibrary]:
    """The optimized BLAS libraries to try, best first (Linux).

    Args:
        with_forward: Whether the forward is there to put in front: the wheel's prefixed
            names serve MLX only through it.
    """
    if sys.platform != "linux":
        return []
    chosen = os.environ.get(CHOICE_ENV, "")
    if chosen:
        path = Path(chosen)
        prefix = WHEEL_PREFIX if path.name.startswith("lib" + WHEEL_PREFIX) else ""
        return [BlasLibrary(path, prefix)] if with_forward or not prefix else []
    found = [wheel_blas() if with_forward else None, system_blas()]
    return [lib for lib in found if lib is not None]


def find_optimized_blas() -> Path | None:
    """The library :func:`load_optimized_blas` tries first, without loading it."""
    candidates = blas_candidates(find_sgemv_forward() is not None)
    return candidates[0].path if candidates else None


def _forward_routes() -> bool:
    """False when ``VELOXQUANT_NO_SGEMV_FORWARD`` asks the forward only to pass calls on."""
    return os.environ.get(FORWARD_OPT_OUT_ENV, "") in ("", "0")


def _opted_out(enabled: bool) -> bool:
    return not enabled or os.environ.get(OPT_OUT_ENV, "") not in ("", "0")


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
        candidates: The libraries to try, best first; by default :func:`blas_candidates`.

    Returns:
        What serves MLX's float32 matmuls now, or None when nothing was loaded.
    """
    if sys.platform != "linux" or _opted_out(enabled) or gpu_expected():
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


def describe_backend(dtype: str | None = None) -> str:
    """One start-up log line: MLX version, the device, the BLAS behind a CPU and the dtype.

    Imports ``mlx.core``, so call it after :func:`load_optimized_blas`.

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
    if _opted_out(True):
        return f"{OPT_OUT_ENV} is set"
    if wheel_blas() is None:
        return f"pip install {WHEEL_MODULE.replace('_', '-')} for ~30x faster float32 matmuls"
    if find_sgemv_forward() is None:
        return ("the BLAS forward (veloxquant_mlx/sgemv_forward.c) is not built: reinstall "
                "with a C compiler for ~30x faster float32 matmuls")
    return "installed but not loaded here: turned off, or see the warning before this line"
