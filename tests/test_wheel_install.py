"""A built wheel, installed into a fresh venv, serves from an empty directory.

Proves the install works away from the source tree: the default config is
read as package data and models are built under ``VELOXQUANT_HOME``, never
inside site-packages or the current directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "veloxquant_mlx", "server")


def _setuptools_builds_wheels() -> bool:
    """Whether this environment's setuptools can build the wheel without isolation."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(part) for part in version.split(".")[:2]) >= (70, 1)


def build_wheel(tmp: Path) -> Path:
    """Build the project's wheel from a copy of its sources; return the wheel file."""
    # A copy, because building in place writes build/ and *.egg-info into a
    # checkout that other processes may be installing from at the same time.
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            shutil.copy2(REPO / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"),
           str(src)]
    if _setuptools_builds_wheels():
        cmd.insert(5, "--no-build-isolation")  # offline and faster
    # The packaging is under test, not the optional mypyc build (see setup.py).
    env = {**os.environ, "VELOXQUANT_PURE_PYTHON": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("veloxquant_mlx-*.whl")
    return wheel


def make_venv(tmp: Path, wheel: Path) -> tuple[Path, Path]:
    """A fresh venv holding the wheel; dependencies come from this test's environment.

    Returns:
        The venv's python and its site-packages folder.
    """
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env={}).stdout.strip())
    # Appended after the venv's own site-packages, and its .pth files are not
    # run, so the project's editable hook there stays inert: the wheel wins.
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    return python, site


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files_under(root: Path) -> set[str]:
    """Every file below ``root`` except bytecode (imports may write that anywhere)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"/health not ok within {timeout}s:\n{log.read_text()}")


@pytest.mark.timeout(480)
def test_wheel_serves_from_an_empty_directory(tmp_path):
    python, site = make_venv(tmp_path, build_wheel(tmp_path))
    cwd, home = tmp_path / "empty", tmp_path / "home"
    cwd.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "user"),
           "VELOXQUANT_HOME": str(home), "VELOXQUANT_NO_BLAS_PRELOAD": "1"}
    where = subprocess.run(
        [str(python), "-c", "import server, veloxquant_mlx, server.settings as s; "
         "print(server.__file__); print(veloxquant_mlx.__file__); print(s.DEFAULT_CONFIG_PATH)"],
        cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where  # not the checkout
    installed = files_under(site)
    assert "server/default_config/default.toml" in installed

    log = tmp_path / "server.log"
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([str(python.parent / "veloxquant-serve"), "--model", "tiny",
                                 "--port", str(port)], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        health = wait_healthy(f"http://127.0.0.1:{port}/health", proc, log)
        assert (health["status"], health["model"]) == ("ok", "tiny")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # The console script (server.__main__:run) drains and exits 0 with no abort.
    assert proc.returncode == 0 and "terminate called" not in log.read_text(), log.read_text()
    assert (home / "models" / "tiny" / "config.json").is_file()
    assert files_under(site) == installed  # nothing written into site-packages
    assert not list(cwd.iterdir())  # nor into the working directory
