"""``StepHistogram`` (server/metrics.py) renders what prometheus-client's Histogram renders.

The engine records a step's token latencies in one call; ``/metrics`` must
still say exactly what a per-value ``Histogram.observe`` would: the same
cumulative buckets (a value on a bound counts in that bucket), count and sum,
parsed back with prometheus-client's own parser.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import ITL_BUCKETS, ServerMetrics, StepHistogram


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("le", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def _both(steps: list[list[float]]) -> tuple[dict, dict]:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    step_histogram = StepHistogram("lat_seconds", "latency", ITL_BUCKETS)
    ours.register(step_histogram)
    reference = Histogram("lat_seconds", "latency", buckets=ITL_BUCKETS, registry=theirs)
    for values in steps:
        step_histogram.observe_many(values)
        for v in values:
            reference.observe(v)
    return _samples(ours), _samples(theirs)


@given(st.lists(st.lists(st.one_of(st.sampled_from(ITL_BUCKETS),
                                   st.floats(0, 5, allow_nan=False)), max_size=70),
                max_size=6))
@settings(max_examples=200, deadline=None)
def test_the_same_samples_as_a_histogram(steps):
    ours, theirs = _both(steps)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value), key


def test_values_on_a_bound_and_past_the_last():
    ours, _ = _both([[0.001, 0.0010001, 2.5, 99.0]])
    assert ours[("lat_seconds_bucket", "0.001")] == 1
    assert ours[("lat_seconds_bucket", "0.0025")] == 2
    assert ours[("lat_seconds_bucket", "2.5")] == 3
    assert ours[("lat_seconds_bucket", "+Inf")] == ours[("lat_seconds_count", "")] == 4
    assert ours[("lat_seconds_sum", "")] == pytest.approx(101.5021001)


def test_threads_recording_and_scraping_lose_nothing():
    histogram = StepHistogram("lat_seconds", "latency", ITL_BUCKETS)
    registry = CollectorRegistry()
    registry.register(histogram)

    def record():
        for _ in range(500):
            histogram.observe_many([0.003] * 8)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen = _samples(registry)  # a scrape never sees a bucket past the count
        assert seen[("lat_seconds_bucket", "+Inf")] == seen[("lat_seconds_count", "")]
    for t in threads:
        t.join()
    assert _samples(registry)[("lat_seconds_count", "")] == 4 * 500 * 8


def test_server_metrics_count_a_steps_tokens():
    class State:
        def __init__(self, generated, first, prev, last):
            self.generated, self.submitted_at = generated, 10.0
            self.first_token_at, self.prev_token_at, self.last_token_at = first, prev, last

    metrics = ServerMetrics()
    metrics.tokens([State(1, 10.25, None, 10.25), State(5, 10.1, 11.0, 11.004),
                    State(2, 10.2, 10.2, 10.23)])
    seen = _samples(metrics.registry)
    assert seen[("veloxquant_generation_tokens_total", "")] == 3
    assert seen[("veloxquant_time_to_first_token_seconds_count", "")] == 1
    assert seen[("veloxquant_time_to_first_token_seconds_bucket", "0.25")] == 1
    assert seen[("veloxquant_inter_token_latency_seconds_count", "")] == 2
    assert seen[("veloxquant_inter_token_latency_seconds_bucket", "0.005")] == 1
    assert seen[("veloxquant_inter_token_latency_seconds_sum", "")] == pytest.approx(0.034)
