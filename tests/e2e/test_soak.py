"""Short soak (CI): benchmark_scripts/soak.py's mixed load, 60 requests, on a real server process.

The long version (300 requests) writes figures/reliability/soak.json:
``flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/soak.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark_scripts"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_short_soak_no_5xx_no_leak_bounded_rss(tmp_path):
    report = soak.soak(n_requests=60, concurrency=16, seed=11, time_budget_s=45.0,
                       warmup_requests=24, log_path=tmp_path / "server.log")
    summary = json.dumps({k: report[k] for k in ("checks", "rss", "server")}, indent=1)
    assert report["passed"], summary
    load = report["load"]
    assert load["requests"] == 60, summary  # none skipped by the time budget
    # The mix really happened: finished, cut and refused requests all occurred.
    assert report["server"]["requests_finished"].get("cancelled", 0) > 0, summary
    assert load["by_status"].get("200", 0) > 30 and load["by_status"].get("400", 0) > 0
    assert report["server"]["blocks_reused"] > 0
