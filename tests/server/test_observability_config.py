"""The shipped Prometheus and Grafana configs match what the server really exports.

Every PromQL expression of ``config/grafana-dashboard.json`` (panel targets
and template queries) is reduced to the metric names it reads, and each name
must be a sample of a live server's ``/metrics`` page, parsed with
``prometheus_client.parser``. Sample names carry the suffixes the queries use
(``_total`` of counters, ``_bucket``/``_sum``/``_count`` of histograms), so a
dashboard querying ``veloxquant_request_latency_seconds_bucket`` passes only if
the server exports that histogram.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import LiveServer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
PROMETHEUS = ROOT / "config" / "prometheus.yml"

# PromQL words that look like identifiers but are not metric names.
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
# Grafana's label_values(metric, label): the second argument is a label name.
_LABEL_VALUES = re.compile(r"label_values\(\s*([^,()]+?)\s*,[^)]*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads.

    Strings, label matchers, range selectors and grouping clauses are removed
    first; what is left are function names (followed by ``(``), keywords,
    numbers and metric names.
    """
    text = _LABEL_VALUES.sub(r"\1", expr)
    text = _STRING.sub('""', text)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _GROUPING.sub("", text)
    text = text.replace("$__rate_interval", "")
    names = set()
    for match in _IDENT.finditer(text):
        rest = text[match.end():].lstrip()
        word = match.group()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expression) for every panel target and every template query."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            out.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']!r}", var["query"]))
    return out


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(a_bucket{instance=~"$instance"}'
            '[$__rate_interval]))) / on (x) b_total + label_values(c, instance)')
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


@pytest.fixture(scope="module")
def exported(live_server: LiveServer) -> dict[str, set[str]]:
    """Sample name -> label names seen on the live /metrics page.

    A completion, a rejected request and a 404 run first so the labelled
    families (created on first use) have samples.
    """
    base = live_server.base_url
    assert httpx.post(base + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": 3}, timeout=60).status_code == 200
    too_big = httpx.post(base + "/v1/completions",
                         json={"prompt": [5] * 5000, "max_tokens": 4000}, timeout=60)
    assert too_big.status_code == 400
    httpx.get(base + "/no-such-route", timeout=10)
    live_server.wait_idle()
    text = httpx.get(base + "/metrics", timeout=10).text
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def test_every_dashboard_expression_reads_exported_metrics(exported):
    expressions = dashboard_expressions()
    assert len(expressions) >= 20
    missing = []
    for where, expr in expressions:
        names = metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        missing += [f"{where}: {name}" for name in sorted(names) if name not in exported]
    assert not missing, "dashboard reads metrics the server does not export:\n" + \
        "\n".join(missing)


def test_grouping_labels_exist(exported):
    """``sum by (reason)`` and friends group by labels the metric really has."""
    for where, expr in dashboard_expressions():
        labels = set()
        for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            labels.update(x.strip() for x in clause.split(",") if x.strip())
        names = metric_names(expr)
        have = set().union(*(exported.get(n, set()) for n in names))
        assert labels <= have, f"{where}: groups by {labels - have} which {names} lack"


def test_dashboard_covers_the_operator_questions():
    """Pool usage, fragmentation, exhaustion, reuse, queues, TTFT, latency, tokens/s."""
    exprs = " ".join(expr for _, expr in dashboard_expressions())
    for needed in ("blocks_in_use", "blocks_total", "fragmentation", "exhausted_total",
                   "reused_total", "requests_running", "requests_waiting",
                   "time_to_first_token_seconds_bucket", "request_latency_seconds_bucket",
                   "generation_tokens_total"):
        assert f"veloxquant_{needed}" in exprs or f"veloxquant_block_pool_{needed}" in exprs
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(titles) == len(set(titles))


def test_prometheus_scrape_example_targets_the_metrics_route():
    text = PROMETHEUS.read_text()
    assert "metrics_path: /metrics" in text
    assert re.search(r'targets: \["127\.0\.0\.1:8000"\]', text)
    # Credentials belong in a file Prometheus reads, never inline.
    assert "credentials:" not in text
