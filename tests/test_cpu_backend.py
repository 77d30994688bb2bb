"""ensure_optimized_blas / describe_backend: the re-exec, its no-op paths, the report line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from veloxquant_mlx import cpu_backend as cb
from veloxquant_mlx.mlx_device import MlxBuild

LIB = cb.find_optimized_blas()
LIB_OK = LIB is not None and cb.probe_blas(LIB)
requires_blas = pytest.mark.skipif(
    not LIB_OK,
    reason="no working optimized BLAS installed (run scripts/install_blas.sh as root)",
)
FORWARD = cb.find_sgemv_forward({})
requires_forward = pytest.mark.skipif(
    not LIB_OK or FORWARD is None,
    reason="needs OpenBLAS and the sgemv forward that `pip install -e .` builds with gcc",
)
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is Linux-only")

# A `python -m` entry point like the server's: it prints a line before the re-exec (seen
# twice when exactly one re-exec happens), then which BLAS serves MLX afterwards.
ENTRY = textwrap.dedent(
    """
    import os, sys
    print("start", flush=True)
    from veloxquant_mlx.cpu_backend import describe_backend, ensure_optimized_blas
    ensure_optimized_blas(sys.argv[1] == "on")
    import mlx.core as mx
    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    maps = open("/proc/self/maps").read()
    print("argv", sys.argv[1:])
    print("marker", os.environ.get("VELOXQUANT_BLAS_PRELOADED", ""))
    print("mapped", os.environ.get("LIB_UNDER_TEST", "?") in maps)
    print("describe", describe_backend("float32"))
    """
)


def _run_entry(tmp_path: Path, mode: str, env: dict[str, str]) -> list[str]:
    (tmp_path / "blas_entry").mkdir(exist_ok=True)
    (tmp_path / "blas_entry" / "__main__.py").write_text(ENTRY)
    env = dict(env, LIB_UNDER_TEST=str(LIB))
    done = subprocess.run(
        [sys.executable, "-m", "blas_entry", mode, "--flag"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    return done.stdout.splitlines()


def _clean_env() -> dict[str, str]:
    """The environment of a user who set nothing: no preload, no marker, no opt-out."""
    env = cb.child_env(preload=False)
    env.pop(cb.OPT_OUT_ENV, None)
    return env


@requires_blas
def test_reexec_once_with_preload_keeps_dash_m_and_args(tmp_path: Path) -> None:
    out = _run_entry(tmp_path, "on", _clean_env())
    assert out.count("start") == 2, out  # exactly one re-exec
    assert "argv ['on', '--flag']" in out
    assert f"marker {LIB}" in out
    assert "mapped True" in out
    describe = next(line for line in out if line.startswith("describe"))
    assert f"preloaded {LIB}" in describe and "dtype float32" in describe
    assert ("one-row products as sgemv" in describe) == (FORWARD is not None)


@requires_blas
def test_disabled_does_not_preload(tmp_path: Path) -> None:
    out = _run_entry(tmp_path, "off", _clean_env())
    assert out.count("start") == 1
    assert "mapped False" in out
    describe = next(line for line in out if line.startswith("describe"))
    assert "bundled reference BLAS" in describe and "mlx_cpu.libs" in describe


@requires_blas
def test_env_opt_out_does_not_preload(tmp_path: Path) -> None:
    out = _run_entry(tmp_path, "on", dict(_clean_env(), VELOXQUANT_NO_BLAS_PRELOAD="1"))
    assert out.count("start") == 1
    assert "mapped False" in out


@linux_only
def test_probe_rejects_what_is_not_a_working_blas(tmp_path: Path) -> None:
    assert not cb.probe_blas(tmp_path / "missing.so")
    libm = next(p for p in (Path("/lib/x86_64-linux-gnu/libm.so.6"), Path("/lib64/libm.so.6"),
                            Path("/usr/lib/libm.so.6"), Path("/lib/aarch64-linux-gnu/libm.so.6"))
                if p.exists())
    assert not cb.probe_blas(libm)  # loads fine, but has no cblas_sgemm


class _ExecCalled(Exception):
    pass


@pytest.fixture
def fake_execve(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record os.execve calls instead of replacing the test process."""
    calls: list[tuple] = []

    def record(path: str, argv: list[str], env: dict[str, str]) -> None:
        calls.append((path, argv, env))
        raise _ExecCalled

    monkeypatch.setattr(cb.os, "execve", record)
    monkeypatch.delenv(cb.OPT_OUT_ENV, raising=False)
    monkeypatch.delenv(cb.MARKER_ENV, raising=False)
    monkeypatch.delenv(cb.THREAD_TIMEOUT_ENV, raising=False)
    return calls


@requires_blas
def test_execve_gets_orig_argv_preload_and_marker(fake_execve: list[tuple],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if cb.active_blas().preloaded:
        pytest.skip("this test process already runs with a preloaded BLAS")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "server", "--port", "9"])
    with pytest.raises(_ExecCalled):
        cb.ensure_optimized_blas(True)
    (path, argv, env), = fake_execve
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "server", "--port", "9"]
    assert env["LD_PRELOAD"].split(":")[:2] == [str(p) for p in cb.preload_list(LIB)]
    assert env[cb.MARKER_ENV] == str(LIB)
    assert env[cb.THREAD_TIMEOUT_ENV] == cb.THREAD_TIMEOUT


def test_no_library_is_a_noop(fake_execve: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cb, "find_optimized_blas", lambda: None)
    monkeypatch.setattr(cb, "_global_symbol_path", lambda name: None)
    cb.ensure_optimized_blas(True)
    assert fake_execve == []


def test_marker_prevents_a_second_reexec(fake_execve: list[tuple],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The preload may not take (e.g. ld.so rejects it): the marker alone stops a loop.
    monkeypatch.setenv(cb.MARKER_ENV, "/some/lib.so")
    monkeypatch.setattr(cb, "_global_symbol_path", lambda name: None)
    cb.ensure_optimized_blas(True)
    assert fake_execve == []


def test_non_linux_is_a_noop(fake_execve: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cb.sys, "platform", "darwin")
    cb.ensure_optimized_blas(True)
    assert fake_execve == []
    assert cb.find_optimized_blas() is None


def test_failing_probe_is_a_noop(fake_execve: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    # A BLAS built for another CPU (SIGILL) must never become the server's process image.
    monkeypatch.setattr(cb, "find_optimized_blas", lambda: Path("/opt/bad/libblas.so.3"))
    monkeypatch.setattr(cb, "_global_symbol_path", lambda name: None)
    monkeypatch.setattr(cb, "probe_blas", lambda path, forward=None: False)
    cb.ensure_optimized_blas(True)
    assert fake_execve == []


def test_child_env_adds_and_strips_the_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = Path("/usr/lib/x/openblas-pthread/libblas.so.3")
    monkeypatch.setattr(cb, "find_optimized_blas", lambda: lib)
    monkeypatch.setattr(cb, "find_sgemv_forward", lambda env=None: None)
    base = {"LD_PRELOAD": f"/other.so:{lib}", cb.OPT_OUT_ENV: "1", "KEEP": "k"}
    on = cb.child_env(preload=True, base=base)
    assert on["LD_PRELOAD"] == f"{lib}:/other.so"
    assert on[cb.MARKER_ENV] == str(lib) and cb.OPT_OUT_ENV not in on and on["KEEP"] == "k"
    assert on[cb.THREAD_TIMEOUT_ENV] == cb.THREAD_TIMEOUT
    chosen = cb.child_env(preload=True, base={cb.THREAD_TIMEOUT_ENV: "20"})
    assert chosen[cb.THREAD_TIMEOUT_ENV] == "20"  # a user's own choice wins
    off = cb.child_env(preload=False, base={**base, cb.MARKER_ENV: str(lib)})
    assert off["LD_PRELOAD"] == "/other.so"
    assert off[cb.OPT_OUT_ENV] == "1" and cb.MARKER_ENV not in off
    assert "LD_PRELOAD" not in cb.child_env(preload=False, base={"LD_PRELOAD": str(lib)})


def _reexec_ready(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    """Everything a re-exec needs, with MLX's build on a GPU or not as ``gpu`` says."""
    monkeypatch.setattr(cb, "find_optimized_blas", lambda: Path("/opt/ok/libblas.so.3"))
    monkeypatch.setattr(cb, "_global_symbol_path", lambda name: None)
    monkeypatch.setattr(cb, "probe_blas", lambda path, forward=None: True)
    monkeypatch.setattr(cb, "gpu_expected", lambda: gpu)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "server"])


def test_gpu_build_skips_the_reexec(fake_execve: list[tuple],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # MLX's CUDA build: matmuls run on cuBLAS, so OpenBLAS would only cost a restart.
    _reexec_ready(monkeypatch, gpu=True)
    cb.ensure_optimized_blas(True)
    assert fake_execve == []
    _reexec_ready(monkeypatch, gpu=False)  # the same process on the CPU build does re-exec
    with pytest.raises(_ExecCalled):
        cb.ensure_optimized_blas(True)
    assert len(fake_execve) == 1


def test_describe_backend_names_the_cpu_and_its_blas() -> None:
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device here is a GPU")
    line = cb.describe_backend("float32")
    device = cb.describe_device(mx, mx.default_device())
    assert line.startswith(f"MLX {mx.__version__} on {device}; BLAS: ")
    assert line.endswith("; dtype float32")
    name = mx.device_info(mx.cpu).get("device_name")
    assert line.startswith(f"MLX {mx.__version__} on cpu ({name}); " if name else
                           f"MLX {mx.__version__} on cpu; ")
    assert ("BLAS: optimized (preloaded " in line) == cb.active_blas().preloaded


def test_describe_backend_says_how_to_unshadow_the_cuda_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device here is a GPU")
    monkeypatch.setattr(cb, "mlx_build",
                        lambda: MlxBuild(cuda=False, cuda_wheel="mlx-cuda-13"))
    line = cb.describe_backend()
    assert ("mlx-cuda-13 is installed but mlx-cpu's libmlx.so replaced its own; for the GPU "
            f"run: pip install --force-reinstall --no-deps mlx-cuda-13=={mx.__version__}") in line


def test_child_env_puts_the_forward_first_unless_opted_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lib, fwd = Path("/usr/lib/x/libblas.so.3"), Path("/src/veloxquant_mlx/_sgemv_forward.so")
    monkeypatch.setattr(cb, "find_optimized_blas", lambda: lib)
    monkeypatch.setattr(cb, "find_sgemv_forward",
                        lambda env=None: None if (env or {}).get(cb.FORWARD_OPT_OUT_ENV) else fwd)
    on = cb.child_env(preload=True, base={"LD_PRELOAD": "/other.so"})
    assert on["LD_PRELOAD"] == f"{fwd}:{lib}:/other.so" and on[cb.MARKER_ENV] == str(lib)
    alone = cb.child_env(preload=True, base={cb.FORWARD_OPT_OUT_ENV: "1"})
    assert alone["LD_PRELOAD"] == str(lib)
    off = cb.child_env(preload=False, base=on)
    assert off["LD_PRELOAD"] == "/other.so"


def test_a_failing_forward_falls_back_to_openblas_alone(
        fake_execve: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    _reexec_ready(monkeypatch, gpu=False)
    fwd = Path("/src/veloxquant_mlx/_sgemv_forward.so")
    monkeypatch.setattr(cb, "find_sgemv_forward",
                        lambda env=None: None if (env or os.environ).get(cb.FORWARD_OPT_OUT_ENV)
                        else fwd)
    monkeypatch.setattr(cb, "probe_blas", lambda path, forward=None: forward is None)
    with pytest.raises(_ExecCalled):
        cb.ensure_optimized_blas(True)
    (_, _, env), = fake_execve
    assert env["LD_PRELOAD"] == "/opt/ok/libblas.so.3"
    assert env[cb.FORWARD_OPT_OUT_ENV] == "1"


# In a child with the preload: every row-major one-row product the forward serves (both
# transposes of each operand, padded leading dimensions, beta 0 over NaN and beta 2), a
# three-row product it passes on, and MLX's own one-row matmul, all against NumPy.
FORWARD_CHECK = textwrap.dedent(
    """
    import ctypes
    import numpy as np
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
    print("ctypes", worst)
    import mlx.core as mx
    x = rng.standard_normal((1, 576), np.float32)
    w = rng.standard_normal((1536, 576), np.float32)
    got = np.array(mx.array(x) @ mx.array(w).T)
    print("mlx", float(np.abs(got - x.astype(np.float64) @ w.T.astype(np.float64)).max()))
    from veloxquant_mlx.cpu_backend import active_blas
    print("active", active_blas())
    """
)


@requires_forward
def test_sgemv_forward_computes_what_sgemm_computes() -> None:
    env = cb.child_env(preload=True, base=dict(os.environ))
    env.pop(cb.FORWARD_OPT_OUT_ENV, None)
    env["LD_PRELOAD"] = f"{FORWARD}:{LIB}"
    done = subprocess.run([sys.executable, "-c", FORWARD_CHECK], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert float(lines["ctypes"]) < 1e-4, done.stdout
    assert float(lines["mlx"]) < 1e-3, done.stdout
    assert f"forward=PosixPath('{FORWARD}')" in lines["active"]
    assert f"path=PosixPath('{LIB}')" in lines["active"]  # the BLAS behind it is named
    assert cb.probe_blas(LIB, forward=FORWARD)
