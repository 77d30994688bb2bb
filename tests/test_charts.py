"""docs/performance.md's charts: each one embedded, present, and what its JSON gives today."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.script_module import load_script

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
CHARTS_DIR = ROOT / "docs" / "charts"


@pytest.fixture(scope="module")
def charts():
    return load_script("render_charts")


@pytest.fixture(scope="module")
def rendered(charts, tmp_path_factory) -> Path:
    """Every chart rendered from figures/ into a scratch folder."""
    out = tmp_path_factory.mktemp("charts")
    charts.render_all(out)
    return out


def embedded() -> list[str]:
    """The chart files the page shows, in page order."""
    return re.findall(r"!\[[^\]]*\]\(charts/([^)\s]+)\)", PAGE.read_text())


def test_every_embedded_chart_exists():
    names = embedded()
    assert names, "docs/performance.md embeds no chart"
    assert [n for n in names if not (CHARTS_DIR / n).is_file()] == []


def test_every_chart_file_is_embedded():
    shown = set(embedded())
    assert sorted(p.name for p in CHARTS_DIR.glob("*.svg") if p.name not in shown) == []


def test_every_embedded_chart_has_a_source(charts):
    assert [n for n in embedded() if n not in charts.CHARTS] == []


@pytest.mark.slow
def test_committed_charts_match_their_json(charts):
    # --check prints what differs to stderr, which pytest shows on failure
    assert charts.main(["--check"]) == 0, "run: python scripts/render_charts.py"


@pytest.mark.slow
def test_check_reports_a_stale_and_a_missing_chart(charts, rendered, tmp_path):
    shutil.copytree(CHARTS_DIR, tmp_path, dirs_exist_ok=True)
    stale, missing = list(charts.CHARTS)[:2]
    (tmp_path / stale).write_text((tmp_path / stale).read_text() + "\n")
    (tmp_path / missing).unlink()
    assert charts.compare(rendered, tmp_path) == [
        f"{stale}: differs from what its JSON gives", f"{missing}: missing"]

