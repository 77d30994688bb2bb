"""benchmark_event_batch.py runs end to end and times both ways of handing events over."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_times_both_ways(tmp_path):
    out = tmp_path / "ev.json"
    subprocess.run([sys.executable, str(ROOT / "benchmark_scripts" / "benchmark_event_batch.py"),
                    "--rows", "1", "4", "--steps", "20", "--rounds", "1", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=120)
    levels = json.loads(out.read_text())["levels"]
    assert [level["rows"] for level in levels] == [1, 4]
    for level in levels:
        per_event, per_step = (level["us_per_step"][k] for k in ("one_call_per_event",
                                                                 "one_call_per_step"))
        assert per_event > 0 and per_step > 0
        assert level["ratio"] == round(per_event / per_step, 2)
