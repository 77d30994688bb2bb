"""Structured outputs on the real default model (SmolLM2-135M-Instruct, as the server serves it).

One request per schema of ``benchmark_scripts/structured_schemas.py`` (nested
objects, arrays of objects, enums, required fields, bounded numbers, a string
pattern) at once, beside two free-text requests, over HTTP to a real
``python -m server`` (``response_format`` on ``/v1/chat/completions``):
every constrained answer ends with ``stop``, parses and validates. It runs
``benchmark_structured.py``'s validity part, which starts that server (with
its optimized BLAS, as ``make serve`` does). The 50-request version is that
script's default.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from veloxquant_mlx.cpu_backend import child_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_every_schema_beside_free_text_validates(tmp_path):
    out = tmp_path / "structured.json"
    cmd = [sys.executable, str(ROOT / "benchmark_scripts" / "benchmark_structured.py"),
           "--skip-cost", "--per-schema", "1", "--free", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(preload=True), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    validity = json.loads(out.read_text())["validity"]
    assert validity["requests_constrained"] == 5 and validity["failures"] == []
    assert validity["valid"] == 5 and validity["finish_reasons"] == {"stop": 5, "length": 0}
    assert set(validity["per_schema"]) == {"person", "order", "weather", "book", "event"}
    assert validity["free_rows_finished"] == 2
