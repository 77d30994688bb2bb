"""benchmark_compiled_decode.py runs end to end, compiles the blocks and compares like with like."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_compares_compiled_and_written_blocks(tmp_path, tiny_model_path):
    out = tmp_path / "cd.json"
    script = ROOT / "benchmark_scripts" / "benchmark_compiled_decode.py"
    subprocess.run([sys.executable, str(script),
                    "--models", "tiny", "--rows", "1", "3", "--steps", "12", "--rounds", "1",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert [(level["model"], level["rows"]) for level in result["levels"]] == [("tiny", 1),
                                                                             ("tiny", 3)]
    for level in result["levels"]:
        assert level["same_tokens"] is True
        written, compiled = level["as_written"], level["compiled"]
        assert (written["compiled_blocks"], compiled["compiled_blocks"]) == (0, 4)
        assert "decode_graph" in compiled["phases_ms_per_step"]
        assert compiled["synced_steps"]["host_ms"] > 0 and written["synced_steps"]["device_ms"] > 0
        assert level["step_ratio"] == round(written["ms_per_step"] / compiled["ms_per_step"], 3)
