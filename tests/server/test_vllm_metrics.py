"""vLLM's metric names (``[metrics] vllm_names``) and the ``model_name`` label on /metrics.

Dashboards, KEDA/HPA rules and gateways written for vLLM select its metric names by a
``model_name`` label. With the switch on, the PromQL of vLLM's own Grafana dashboard
(``fixtures/vllm_grafana_queries.json``, copied from vLLM's repository) must read
metrics a live server exports, labelled with the served model's name, except the panels
listed in :data:`UNSERVED`.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics_collectors import kv_usage_ratio
from tests.server.test_observability_config import metric_names
from tests.support.servers import LiveServer, make_settings, run_server
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_grafana_queries.json"
SERVED = "tiny-vllm-named"
# Panels of vLLM's dashboard that read values this server does not measure.
UNSERVED = {
    "Request Prompt Length": "no per-request prompt-length histogram",
    "Request Generation Length": "no per-request output-length histogram",
    "Requests Prefill and Decode Time": "no per-request prefill and decode time histograms",
    "Max Generation Token in Sequence Group": "no max_tokens histogram",
}
# vLLM's type of each family the server exports under its name.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def scrape(base_url: str) -> list:
    return list(text_string_to_metric_families(httpx.get(base_url + "/metrics",
                                                         timeout=10).text))


def samples_by_name(families: list) -> dict[str, list[dict[str, str]]]:
    """Sample name (``_total``, ``_bucket``, ... included) -> the label sets it has."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in families:
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.labels)
    return out


@pytest.fixture(scope="module")
def vllm_server(tiny_model_path: Path):
    settings = make_settings(model={"path": str(tiny_model_path), "served_name": SERVED},
                             metrics={"vllm_names": True})
    with run_server(settings) as server:
        # One completion gives every family samples: it ends by length.
        answer = httpx.post(server.base_url + "/v1/completions",
                            json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                            timeout=60)
        assert answer.status_code == 200
        server.wait_idle()
        yield server


def dashboard() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_fixture_is_vllms_dashboard():
    panels = dashboard()["panels"]
    assert len(panels) == 12 and UNSERVED.keys() <= {p["title"] for p in panels}
    assert all(name.startswith("vllm:") for p in panels for e in p["exprs"]
               for name in metric_names(e))


def test_every_served_panel_of_vllms_dashboard_reads_labelled_metrics(vllm_server):
    exported = samples_by_name(scrape(vllm_server.base_url))
    missing, unlabelled = [], []
    for panel in dashboard()["panels"]:
        names = {n for e in panel["exprs"] for n in metric_names(e)}
        if panel["title"] in UNSERVED:
            assert not names & exported.keys(), f"{panel['title']} is served: drop it from UNSERVED"
            continue
        missing += [f"{panel['title']}: {n}" for n in sorted(names - exported.keys())]
        unlabelled += [f"{panel['title']}: {n}" for n in sorted(names & exported.keys())
                       if any(labels.get("model_name") != SERVED for labels in exported[n])]
    assert not missing, "vLLM's dashboard reads metrics we do not export:\n" + "\n".join(missing)
    assert not unlabelled, "without model_name=" + SERVED + ":\n" + "\n".join(unlabelled)


def test_the_dashboards_groupings_and_model_variable_resolve(vllm_server):
    exported = samples_by_name(scrape(vllm_server.base_url))
    for panel in dashboard()["panels"]:
        if panel["title"] in UNSERVED:
            continue
        for expr in panel["exprs"]:
            grouped = {x.strip() for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr)
                       for x in clause.split(",")}
            have = {k for n in metric_names(expr) for labels in exported[n] for k in labels}
            assert grouped <= have, f"{panel['title']}: groups by {grouped - have}"
    # The dashboard's model picker: label_values({__name__=~"vllm:.*"}, model_name).
    (variable,) = dashboard()["variables"]
    assert variable["query"] == 'label_values({__name__=~"vllm:.*"},model_name)'
    models = {labels.get("model_name") for name, sets in exported.items()
              if name.startswith("vllm:") for labels in sets}
    assert models == {SERVED}


def test_vllm_families_have_vllms_types_and_our_values(vllm_server):
    families = {f.name: f for f in scrape(vllm_server.base_url)}
    assert {n: families[n].type for n in VLLM_TYPES} == VLLM_TYPES

    def value(name: str, sample: str, **labels: str) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name == sample and labels.items() <= s.labels.items())

    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == value(
        "veloxquant_generation_tokens", "veloxquant_generation_tokens_total") > 0
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == value(
        "veloxquant_prompt_tokens", "veloxquant_prompt_tokens_total") > 0
    assert value("vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") == value(
        "veloxquant_request_finished", "veloxquant_request_finished_total", reason="length") == 1
    for ours, theirs in (("veloxquant_time_to_first_token_seconds",
                          "vllm:time_to_first_token_seconds"),
                         ("veloxquant_request_latency_seconds",
                          "vllm:e2e_request_latency_seconds"),
                         ("veloxquant_inter_token_latency_seconds",
                          "vllm:inter_token_latency_seconds"),
                         ("veloxquant_inter_token_latency_seconds",
                          "vllm:time_per_output_token_seconds")):
        assert value(theirs, theirs + "_count") == value(ours, ours + "_count") > 0
    assert value("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == value(
        "veloxquant_kv_usage_ratio", "veloxquant_kv_usage_ratio") == 0  # idle: cache evictable


def test_a_client_that_leaves_is_vllms_abort(vllm_server):
    body = {"prompt": "a b c", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", vllm_server.base_url + "/v1/completions", json=body,
                      timeout=60) as answer:
        lines = answer.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        for _ in range(200):  # until the engine runs it (at most 20 s)
            families = {f.name: f for f in scrape(vllm_server.base_url)}
            (running,) = families["vllm:num_requests_running"].samples
            if running.value:
                break
            time.sleep(0.1)
        (usage,) = families["vllm:kv_cache_usage_perc"].samples
        assert running.value == 1 and running.labels == {"model_name": SERVED}
        assert 0 < usage.value <= 1 and usage.labels == {"model_name": SERVED}
    for _ in range(200):  # until the engine has seen the client leave (at most 20 s)
        if vllm_server.metrics().get("veloxquant_request_finished_total{reason=cancelled}"):
            break
        time.sleep(0.1)
    families = {f.name: f for f in scrape(vllm_server.base_url)}
    assert {s.labels["finished_reason"]: s.value
            for s in families["vllm:request_success"].samples
            if s.name.endswith("_total")} == {"length": 1, "abort": 1}


def test_the_switch_is_off_by_default_and_the_request_metrics_carry_model_name(
        live_server: LiveServer):
    httpx.post(live_server.base_url + "/v1/completions",
               json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    live_server.wait_idle()
    families = scrape(live_server.base_url)
    assert not [f.name for f in families if f.name.startswith("vllm:")]
    model = live_server.engine.model_name
    seen = set()
    for family in families:
        if family.name in LABELLED | {"veloxquant_request_rejected"}:
            seen.add(family.name)
            assert all(s.labels.get("model_name") == model for s in family.samples), family.name
        elif family.name.startswith("veloxquant_block_pool"):  # the pool's: no model label
            assert all("model_name" not in s.labels for s in family.samples), family.name
    assert LABELLED <= seen
    weights = next(f for f in families if f.name == "veloxquant_model_weight_bytes")
    assert weights.samples[0].value == live_server.engine.loaded.weight_bytes > 0


# The families the model's name labels: the request metrics and the load gauges.
LABELLED = {
    "veloxquant_requests_running", "veloxquant_requests_waiting", "veloxquant_kv_usage_ratio",
    "veloxquant_prompt_tokens", "veloxquant_generation_tokens", "veloxquant_request_finished",
    "veloxquant_time_to_first_token_seconds", "veloxquant_inter_token_latency_seconds",
    "veloxquant_request_latency_seconds", "veloxquant_queue_wait_seconds",
    "veloxquant_request_kv_blocks", "veloxquant_model_weight_bytes",
}


def test_kv_usage_counts_what_admission_cannot_hand_out():
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=20))
    cache = pool.prefix_cache
    assert kv_usage_ratio(pool, cache) == 0
    k, v = pool.allocate("k", 48, owner=1), pool.allocate("v", 48, owner=1)
    assert kv_usage_ratio(pool, cache) == 6 / 20
    assert cache.publish(1, b"first block", [k[0], v[0]])
    assert kv_usage_ratio(pool, cache) == 6 / 20  # cached, and the request still uses it
    # The request ends: its own blocks go back and the cached pair becomes evictable, free
    # for admission as in vLLM's free queue, though the pool still counts it in use.
    cache.release(1)
    pool.free_all(1)
    assert pool.stats.snapshot().as_dict()["blocks_in_use"] == 2
    assert kv_usage_ratio(pool, cache) == 0
    cache.acquire(2, cache.match([b"first block"]))  # a later request shares it
    assert kv_usage_ratio(pool, cache) == 2 / 20
    assert kv_usage_ratio(pool, None) == 2 / 20  # caching off: nothing is evictable
