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


def test_pure_python_switch_loads_the_source():
    code = "import veloxquant_mlx.memory as m; print(m.NATIVE_ALLOCATOR)"
    env = {**os.environ, "VELOXQUANT_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(not memory.NATIVE_ALLOCATOR, reason="this run already uses pure Python")
def test_allocator_tests_pass_on_the_pure_python_source():
    env = {**os.environ, "VELOXQUANT_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ALLOCATOR_TESTS],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout
