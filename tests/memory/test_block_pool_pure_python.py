"""The allocator tests again on the pure-Python source when the compiled build is in use.

setup.py compiles the allocator with mypyc where it can; both builds must
behave the same, so the allocator's own tests also run with
VELOXQUANT_PURE_PYTHON=1 (in a subprocess: the choice is made at import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import veloxquant_mlx.memory as memory

HERE = Path(__file__).parent
ALLOCATOR_TESTS = sorted(str(p) for p in HERE.glob("test_block_pool*.py") if "pure" not in p.name)


@pytest.mark.slow
def test_pure_python_switch_loads_the_source():
    code = "import veloxquant_mlx.memory as m; print(m.NATIVE_ALLOCATOR)"
    env = {**os.environ, "VELOXQUANT_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(not memory.NATIVE_ALLOCATOR, reason="this run already uses pure Python")
@pytest.mark.slow
def test_allocator_tests_pass_on_the_pure_python_source():
    env = {**os.environ, "VELOXQUANT_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ALLOCATOR_TESTS],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout


def test_a_compiled_build_is_judged_by_its_source_hash_not_file_times(tmp_path):
    """pip does not keep a wheel's file times, so a fresh wheel install may write a
    module's .so before its .py; only the build's recorded source hash tells stale
    from fresh (by file times, every wheel install would fall back to pure Python)."""
    import hashlib

    from veloxquant_mlx.memory import _built_from_other_source

    source = tmp_path / "records.py"
    source.write_text("X = 1\n")
    ext = tmp_path / "records.cpython-311-x86_64-linux-gnu.so"
    ext.write_bytes(b"")
    os.utime(ext, (1, 1))  # older than its source, as after a wheel install
    assert _built_from_other_source(ext, source)  # no stamp: file times decide
    stamp = tmp_path / "records.source-sha256"
    stamp.write_text(hashlib.sha256(source.read_bytes()).hexdigest() + "\n")
    assert not _built_from_other_source(ext, source)
    source.write_text("X = 2\n")  # edited after the build
    assert _built_from_other_source(ext, source)


@pytest.mark.skipif(bool(os.environ.get("VELOXQUANT_PURE_PYTHON")), reason="pure Python asked")
def test_a_fresh_compiled_build_is_used():
    """Where the install compiled the allocator from today's source, it is the one in use."""
    here = Path(memory.__file__).parent
    built = list(here.glob("block_pool.*.so"))
    if not built:
        pytest.skip("the install did not compile the allocator (no mypyc or compiler)")
    assert (here / "block_pool.source-sha256").is_file()  # setup.py's stamp
    assert memory.NATIVE_ALLOCATOR
