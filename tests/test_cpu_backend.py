"""load_optimized_blas / describe_backend: loading in place, the fallbacks, the report line.

Loading has to happen before MLX is imported, so every check that loads runs in a child
Python (``python -c``) started from the repository; the pytest process only runs the
checks that return before anything is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_quant_weights import _has_avx2_fma
from veloxquant_mlx import blas_finder, blas_status
from veloxquant_mlx import cpu_backend as cb
from veloxquant_mlx.mlx_device import MlxBuild

ROOT = Path(__file__).resolve().parents[1]
FORWARD = blas_finder.find_sgemv_forward()
WHEEL = blas_finder.wheel_blas()
SYSTEM = blas_finder.system_blas()
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the loader is Linux-only")
requires_wheel = pytest.mark.skipif(
    WHEEL is None or FORWARD is None,
    reason="needs the scipy-openblas32 wheel and the forward `pip install -e .` builds with gcc",
)
requires_system = pytest.mark.skipif(
    SYSTEM is None or FORWARD is None,
    reason="needs a distribution OpenBLAS (scripts/install_blas.sh, as root) and the forward",
)


def _child(code: str, *, env: dict[str, str] | None = None,
           prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python from the repository (nothing loaded yet)."""
    env = dict(cb.child_env(preload=True) if env is None else env)
    env.pop(cb.THREAD_TIMEOUT_ENV, None)
    env.pop("LD_PRELOAD", None)  # so that a preload seen in the child is the project's
    return subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _report(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Loads as the server does, then has MLX multiply float32 matrices: the forward's call
# counter shows MLX's cblas_sgemm landing in it, /proc/self/maps the library behind it.
SERVES_MLX = """
    import json, os, sys
    import numpy as np
    from veloxquant_mlx import blas_status, cpu_backend as cb
    pid = os.getpid()
    first = cb.load_optimized_blas()
    again = cb.load_optimized_blas()  # reports, loads nothing twice
    import mlx.core as mx
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1, 576), np.float32)
    b = rng.standard_normal((1536, 576), np.float32)
    c = rng.standard_normal((96, 576), np.float32)
    before = blas_status.forward_calls()
    one_row = np.array(mx.array(a) @ mx.array(b).T)
    rows = np.array(mx.array(c) @ mx.array(b).T)
    calls = blas_status.forward_calls() - before
    want = lambda x: x.astype(np.float64) @ b.T.astype(np.float64)
    print(json.dumps({
        "loaded": str(first.path), "again": str(again.path), "forward": str(first.forward),
        "calls": calls, "mapped": str(first.path) in open("/proc/self/maps").read(),
        "error": max(float(np.abs(one_row - want(a)).max()), float(np.abs(rows - want(c)).max())),
        "thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
        "same_pid": os.getpid() == pid, "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "describe": blas_status.describe_backend("float32"),
    }))
"""


@requires_wheel
@pytest.mark.slow
def test_the_wheel_serves_mlx_float32_matmuls_through_the_forward() -> None:
    report = _report(_child(SERVES_MLX))
    assert report["loaded"] == report["again"] == str(WHEEL.path)
    assert report["forward"] == str(FORWARD)
    assert report["calls"] >= 2 and report["mapped"]  # both products came through us
    assert report["error"] < 1e-3
    assert report["thread_timeout"] == cb.THREAD_TIMEOUT
    assert report["same_pid"] and report["ld_preload"] == ""
    assert f"BLAS: optimized (loaded {WHEEL.path}; OpenBLAS " in report["describe"]
    assert "one-row products as sgemv" in report["describe"]


@requires_wheel
@pytest.mark.slow
def test_a_thread_timeout_of_ones_own_is_kept() -> None:
    env = dict(cb.child_env(preload=True), **{cb.THREAD_TIMEOUT_ENV: "20"})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SERVES_MLX)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert _report(done)["thread_timeout"] == "20"


# The server's entry point with exec replaced by a failure: start-up loads the BLAS in
# place, in the process that printed "start".
ENTRY = """
    import json, os, sys
    def no_exec(*args, **kwargs):
        raise SystemExit("exec called")
    for name in [n for n in dir(os) if n.startswith(("exec", "spawn"))]:
        setattr(os, name, no_exec)
    print("start", os.getpid(), flush=True)
    import server.__main__ as entry
    from veloxquant_mlx import blas_status

    def report(settings):
        import mlx.core as mx
        before = blas_status.forward_calls()
        mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))
        print(json.dumps({"pid": os.getpid(), "loaded": str(blas_status.active_blas().path),
                          "calls": blas_status.forward_calls() - before}))
        return 0

    entry._serve = report
    sys.exit(entry.main(["--model", "tiny"]))
"""


@requires_wheel
@pytest.mark.slow
def test_the_server_entry_point_loads_in_place_without_exec() -> None:
    done = _child(ENTRY)
    report = _report(done)
    starts = [line for line in done.stdout.splitlines() if line.startswith("start")]
    assert starts == [f"start {report['pid']}"]  # printed once, by this very process
    assert report["loaded"] == str(WHEEL.path) and report["calls"] >= 1


@pytest.mark.parametrize("which", ["wheel", "system", "wheel, pass-through"])
@pytest.mark.slow
def test_the_forward_computes_what_sgemm_computes(which: str) -> None:
    """Every row-major one-row product the forward serves (both transposes of each
    operand, padded leading dimensions, beta 0 over NaN and beta 2) and a three-row product
    it passes on, called as MLX calls them, against NumPy; over each BLAS it binds."""
    lib = SYSTEM if which == "system" else WHEEL
    if lib is None or FORWARD is None:
        pytest.skip(f"no {which} BLAS or no forward here")
    env = cb.child_env(preload=True)
    if "pass-through" in which:
        env[cb.FORWARD_OPT_OUT_ENV] = "1"
    code = f"from veloxquant_mlx.blas_finder import BlasLibrary\n" \
           f"lib = BlasLibrary({str(lib.path)!r}, {lib.prefix!r})\n" + FORWARD_CHECK
    report = _report(_child(code, env=env))
    assert report["loaded"] == str(lib.path)
    assert report["ctypes"] < 1e-4 and report["mlx"] < 1e-3, report
    assert report["routes"] == ("pass-through" not in which)
    # The codes operation (veloxquant_mlx/kernels) does not ride on the forward: the
    # opt-out leaves it, on its AVX2 path where the CPU has AVX2 and FMA; its float32 path
    # (products of many rows) finds the cblas_sgemm MLX calls.
    if report["codes_path"] is not None:  # None: the operation cannot be built here
        assert report["codes_path"] == ("avx2" if _has_avx2_fma() else "portable"), report
        assert report["codes_float32"], report


FORWARD_CHECK = """
import ctypes, json
import numpy as np
from veloxquant_mlx import cpu_backend as cb
active = cb.load_optimized_blas(candidates=[lib])
g = ctypes.CDLL(None)
f = g.cblas_sgemm
f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
              ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
rng = np.random.default_rng(0)
n, k, pad = 37, 53, 5
worst = 0.0
for m in (1, 3):
    for ta in (111, 112):
        for tb in (111, 112):
            for beta in (0.0, 2.0):
                a_shape = (m, k) if ta == 111 else (k, m)
                b_shape = (k, n) if tb == 111 else (n, k)
                a = rng.standard_normal((a_shape[0], a_shape[1] + pad), np.float32)
                b = rng.standard_normal((b_shape[0], b_shape[1] + pad), np.float32)
                c0 = (np.full((m, n), np.nan, np.float32) if beta == 0.0
                      else rng.standard_normal((m, n), np.float32))
                c = c0.copy()
                op_a = a[:, : a_shape[1]] if ta == 111 else a[:, : a_shape[1]].T
                op_b = b[:, : b_shape[1]] if tb == 111 else b[:, : b_shape[1]].T
                f(101, ta, tb, m, n, k, 0.5, a.ctypes.data, a.shape[1], b.ctypes.data,
                  b.shape[1], beta, c.ctypes.data, n)
                want = 0.5 * (op_a.astype(np.float64) @ op_b)
                if beta:
                    want += beta * c0
                worst = max(worst, float(np.abs(c - want).max()))
import mlx.core as mx
x = rng.standard_normal((1, 576), np.float32)
w = rng.standard_normal((1536, 576), np.float32)
got = np.array(mx.array(x) @ mx.array(w).T)
from veloxquant_mlx.kernels.build import KernelBuildError, load
try:
    codes = load()
    codes_path, codes_float32 = codes.kernel_path(), codes.float32_available()
except KernelBuildError:  # no cmake or C++ compiler here: tests/test_codes_matmul.py skips
    codes_path = codes_float32 = None
print(json.dumps({"loaded": str(active.path), "routes": active.routes, "ctypes": worst,
                  "mlx": float(np.abs(got - x.astype(np.float64) @ w.T.astype(np.float64)).max()),
                  "codes_path": codes_path, "codes_float32": codes_float32}))
"""

# Loads from the libraries named on its command line (or a distribution OpenBLAS looked
# for where ``--system`` says); prints what serves MLX afterwards.
FALLBACK = """
    import json, sys
    from pathlib import Path
    from veloxquant_mlx import blas_finder, blas_status, cpu_backend as cb
    if sys.argv[1] == "--system":
        candidates = [blas_finder.system_blas([sys.argv[2]])]
    else:
        candidates = [blas_finder.BlasLibrary(Path(p)) for p in sys.argv[1:]]
    loaded = cb.load_optimized_blas(candidates=candidates)
    import mlx.core as mx
    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    print(json.dumps({"loaded": loaded is not None, "describe": blas_status.describe_backend()}))
"""


def _fallback(args: list[str], prefix: list[str] | None = None) -> tuple[dict, str]:
    """Run FALLBACK with ``args``: its report and its stderr."""
    done = subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(FALLBACK),
                           *args], cwd=ROOT, env=cb.child_env(preload=True),
                          capture_output=True, text=True, timeout=120)
    return _report(done), done.stderr


def _without_file_permission_override() -> list[str] | None:
    """A command prefix under which file permissions bind this process (root included)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return None if setpriv is None else [setpriv, "--bounding-set",
                                         "-dac_override,-dac_read_search"]


@linux_only
@pytest.mark.slow
def test_an_unreadable_blas_falls_back_with_one_warning(tmp_path: Path) -> None:
    """The library's folder may not be searched: the bundled BLAS serves, one line says why."""
    prefix = _without_file_permission_override()
    if prefix is None:
        pytest.skip("root without setpriv: file permissions cannot bind here")
    locked = tmp_path / "locked"
    locked.mkdir()
    if SYSTEM is not None:
        shutil.copy(SYSTEM.path, locked / "libblas.so.3")
    locked.chmod(0)
    try:
        report, stderr = _fallback(["--system", str(locked / "libblas.so.3")], prefix)
    finally:
        locked.chmod(0o700)
    assert report["loaded"] is False
    assert "bundled reference BLAS" in report["describe"]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "optimized BLAS not loaded" in lines[0] and "Permission denied" in lines[0]


@linux_only
@pytest.mark.slow
def test_a_broken_blas_falls_back_with_one_warning(tmp_path: Path) -> None:
    """Not a library, and a library without sgemm: both named on one line, no traceback."""
    garbage = tmp_path / "libblas.so.3"
    garbage.write_bytes(b"not an ELF file\n" * 64)
    libm = next(p for p in (Path("/lib/x86_64-linux-gnu/libm.so.6"), Path("/lib64/libm.so.6"),
                            Path("/usr/lib/libm.so.6"), Path("/lib/aarch64-linux-gnu/libm.so.6"))
                if p.exists())
    report, stderr = _fallback([str(garbage), str(libm)])
    assert report["loaded"] is False and "bundled reference BLAS" in report["describe"]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert str(garbage) in lines[0] and str(libm) in lines[0]


# A BLAS built for another CPU: its sgemm dies with an illegal instruction.
TRAPPING_BLAS = """
void cblas_sgemm(void) { __builtin_trap(); }
void cblas_sgemv(void) { __builtin_trap(); }
"""


@linux_only
@pytest.mark.slow
def test_a_blas_that_crashes_is_caught_by_the_probe(tmp_path: Path) -> None:
    """The check runs in a child: the crash ends the child, never the loading process."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc to build the crashing library")
    source, lib = tmp_path / "trap.c", tmp_path / "libblas.so.3"
    source.write_text(TRAPPING_BLAS)
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    report, stderr = _fallback([str(lib)])
    assert report["loaded"] is False and "bundled reference BLAS" in report["describe"]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "died with signal" in lines[0] and str(lib) in lines[0], stderr


@requires_wheel
@pytest.mark.slow
def test_after_mlx_is_imported_nothing_loads_and_one_line_says_why() -> None:
    done = _child("""
        import mlx.core
        from veloxquant_mlx import blas_status, cpu_backend as cb
        print(cb.load_optimized_blas() is None, blas_status.active_blas().loaded)
    """)
    assert done.stdout.split() == ["True", "False"], done.stderr
    assert "MLX is already imported" in done.stderr and "Traceback" not in done.stderr


@requires_wheel
@pytest.mark.parametrize("how", ["env", "setting"])
@pytest.mark.slow
def test_the_opt_outs_leave_mlx_on_its_bundled_blas(how: str) -> None:
    env = cb.child_env(preload=how != "env")
    done = _child(f"""
        from veloxquant_mlx import blas_status, cpu_backend as cb
        print(cb.load_optimized_blas({how != "setting"}))
        import mlx.core as mx
        mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
        print(blas_status.describe_backend())
    """, env=env)
    first, describe = done.stdout.strip().splitlines()
    assert first == "None" and "bundled reference BLAS" in describe, done.stderr
    assert str(WHEEL.path) not in describe


def test_nothing_loads_for_a_gpu_or_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLX's CUDA build runs matmuls on cuBLAS; macOS on Metal or Accelerate.
    monkeypatch.setattr(cb, "gpu_expected", lambda: True)
    assert cb.load_optimized_blas(True) is None
    monkeypatch.setattr(cb, "gpu_expected", lambda: False)
    monkeypatch.setattr(cb.sys, "platform", "darwin")
    assert cb.load_optimized_blas(True) is None
    assert blas_finder.find_optimized_blas() is None and blas_finder.find_sgemv_forward() is None


def test_the_wheel_is_tried_first_and_only_with_the_forward() -> None:
    if sys.platform != "linux":
        pytest.skip("the loader is Linux-only")
    with_forward = blas_finder.blas_candidates(with_forward=True)
    without = blas_finder.blas_candidates(with_forward=False)
    assert all(lib.prefix == "" for lib in without)  # prefixed names need the forward
    if WHEEL is not None:
        assert with_forward[0] == WHEEL and WHEEL.symbol("cblas_sgemm") == "scipy_cblas_sgemm"
    if SYSTEM is not None:
        assert with_forward[-1] == without[0] == SYSTEM


def test_a_chosen_blas_library_is_the_only_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform != "linux":
        pytest.skip("the loader is Linux-only")
    monkeypatch.setenv(blas_finder.CHOICE_ENV, "/opt/blas/libopenblas.so.0")
    assert blas_finder.blas_candidates(with_forward=False) == [blas_finder.BlasLibrary(
        Path("/opt/blas/libopenblas.so.0"))]
    monkeypatch.setenv(blas_finder.CHOICE_ENV, "/opt/w/libscipy_openblas.so")
    assert blas_finder.blas_candidates(with_forward=True) == [blas_finder.BlasLibrary(
        Path("/opt/w/libscipy_openblas.so"), blas_finder.WHEEL_PREFIX)]
    assert blas_finder.blas_candidates(with_forward=False) == []  # prefixed names need the forward


@pytest.mark.skipif(SYSTEM is None, reason="no distribution OpenBLAS installed")
@pytest.mark.slow
def test_a_chosen_distribution_blas_serves_mlx() -> None:
    env = dict(cb.child_env(preload=True), **{blas_finder.CHOICE_ENV: str(SYSTEM.path)})
    report = _report(_child(SERVES_MLX, env=env))
    assert report["loaded"] == str(SYSTEM.path) and report["mapped"]
    assert report["calls"] >= 2 and report["error"] < 1e-3


def test_child_env_only_sets_or_clears_the_opt_out() -> None:
    base = {blas_finder.OPT_OUT_ENV: "1", "KEEP": "k", "LD_PRELOAD": "/other.so"}
    on = cb.child_env(preload=True, base=base)
    assert on == {"KEEP": "k", "LD_PRELOAD": "/other.so"}
    off = cb.child_env(preload=False, base={"KEEP": "k"})
    assert off == {"KEEP": "k", blas_finder.OPT_OUT_ENV: "1"}


def test_describe_backend_names_the_cpu_and_its_blas() -> None:
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device here is a GPU")
    line = blas_status.describe_backend("float32")
    device = blas_status.describe_device(mx, mx.default_device())
    assert line.startswith(f"MLX {mx.__version__} on {device}; BLAS: ")
    assert line.endswith("; dtype float32")
    name = mx.device_info(mx.cpu).get("device_name")
    assert line.startswith(f"MLX {mx.__version__} on cpu ({name}); " if name else
                           f"MLX {mx.__version__} on cpu; ")
    assert ("BLAS: optimized (loaded " in line) == blas_status.active_blas().loaded


def test_describe_backend_says_how_to_unshadow_the_cuda_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device here is a GPU")
    monkeypatch.setattr(blas_status, "mlx_build",
                        lambda: MlxBuild(cuda=False, cuda_wheel="mlx-cuda-13"))
    line = blas_status.describe_backend()
    assert ("mlx-cuda-13 is installed but mlx-cpu's libmlx.so replaced its own; for the GPU "
            f"run: pip install --force-reinstall --no-deps mlx-cuda-13=={mx.__version__}") in line
