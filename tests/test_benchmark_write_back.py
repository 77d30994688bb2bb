"""benchmark_write_back.py runs end to end and counts what write-back changes (arena writes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_counts_fewer_arena_writes_with_write_back(tmp_path, tiny_model_path):
    out = tmp_path / "wb.json"
    subprocess.run([sys.executable, str(ROOT / "benchmark_scripts" / "benchmark_write_back.py"),
                    "--rows", "1", "3", "--steps", "40", "--rounds", "1", "--n-blocks", "1024",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert [level["rows"] for level in result["levels"]] == [1, 3]
    for level in result["levels"]:
        every, held = level["write_every_step"], level["write_back_32"]
        assert every["arena_writes"] == 40  # one write per decode step
        # 5 warm-up calls held; the 33rd held call writes the 32 before it
        assert held["arena_writes"] == 1
        assert every["ms_per_step"] > 0 and "decode_graph" in held["phases_ms_per_step"]
        for run in (every, held):  # synced steps after the timed ones: host and device parts
            assert run["synced_steps"]["host_ms"] > 0 and run["synced_steps"]["device_ms"] > 0
        assert level["step_ratio"] == round(every["ms_per_step"] / held["ms_per_step"], 3)
