"""Server metrics on a private prometheus-client registry.

``/metrics`` renders this one registry. This module holds what the engine and the routes
record into (:class:`ServerMetrics`); the collectors that read their values at scrape time
instead (the pool's counters, the engine's gauges) are :mod:`server.metrics_collectors`.
The per-request metrics and the load gauges carry the served model's name as
``model_name`` (:class:`ModelLabelled`); with ``[metrics] vllm_names`` they also go
out under vLLM's names (:class:`VllmNames`).
The registry is private to each app, so tests can build many apps.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class StepHistogram:
    """A histogram filled a decode step at a time: one lock per step, not per token.

    The engine records a latency per generated token. prometheus-client's
    ``Histogram.observe`` takes its locks and walks the buckets in Python for
    each one; with the token counter's ``inc`` that costs 244 us of every 64-row
    step on the engine thread, whose Python a GPU step waits for, where this
    costs 27 us (``benchmark_scripts/benchmark_token_metrics.py``). Here a step's values
    are bucketed with ``bisect`` and added under one lock; ``/metrics`` renders
    the same ``_bucket``/``_count``/``_sum`` samples (a bucket counts values
    <= its bound, as there).

    Args:
        name: Metric name (no suffix).
        documentation: Its help text.
        buckets: Upper bounds, ascending (``+Inf`` is added).
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = sorted(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        """Count ``values`` (any thread)."""
        if not values:
            return
        slots = [bisect.bisect_left(self.bounds, v) for v in values]
        total = sum(values)
        with self._lock:
            counts = self._counts
            for slot in slots:
                counts[slot] += 1
            self._sum += total

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=total)


MODEL_LABEL = "model_name"


class ModelLabelled:
    """Collectors whose every sample gets the served model's name as ``model_name``.

    vLLM's dashboards, autoscaling rules and gateways select by that label. One server
    serves one model, so the label has one value, and it is added when ``/metrics`` is
    read: the engine thread records without a label lookup, and the name, known only once
    the model loads, is read then. Until :attr:`model_name` is bound (or while it gives
    ""), no label is added: Prometheus reads an empty label as none.

    Args:
        collectors: prometheus-client metrics (or anything with ``collect`` and
            ``describe``), not registered elsewhere.
    """

    def __init__(self, collectors: list[Any]) -> None:
        self.collectors = collectors
        self.model_name: Callable[[], str] = lambda: ""

    def describe(self):
        return [family for collector in self.collectors for family in collector.describe()]

    def collect(self):
        name = self.model_name()
        for collector in self.collectors:
            for family in collector.collect():
                yield with_model_label(family, name) if name else family


def with_model_label(family: Metric, name: str) -> Metric:
    """A copy of ``family`` whose samples carry ``model_name=name``."""
    labelled = Metric(family.name, family.documentation, family.type, family.unit)
    labelled.samples = [s._replace(labels={**s.labels, MODEL_LABEL: name})
                        for s in family.samples]
    return labelled


class RequestEndListener(Protocol):
    """Told of every request end the engine records (the request log is one)."""

    def finished(self, state: Any, reason: Any, kv_blocks: int, failure: Any) -> None:
        """A request that ran ended."""

    def rejected(self, request: Any, reason: Any, prompt_tokens: int | None,
                 waited_s: float | None) -> None:
        """A request was refused or dropped before it ran (size and wait where known)."""


class ServerMetrics:
    """Counters and histograms the routes and the engine record into.

    Every method is thread-safe (prometheus-client locks its values); the
    engine calls :meth:`tokens` once per step with that step's tokens.
    Request ends are also passed to each of :attr:`listeners`.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("veloxquant_requests", "HTTP requests by route and status code.",
                                ["endpoint", "status"], registry=r)
        # By endpoint only: a label per field name would let clients grow the series.
        self.unknown_fields = Counter("veloxquant_request_unknown_fields",
                                      "Top-level request fields no endpoint knows, ignored or "
                                      "refused per server.unknown_fields.", ["endpoint"],
                                      registry=r)
        # The per-request metrics reach the registry through self.per_request, which
        # labels them with the served model's name.
        self.prompt_tokens = Counter("veloxquant_prompt_tokens", "Prompt tokens admitted.",
                                     registry=None)
        self.generation_tokens = Counter("veloxquant_generation_tokens",
                                         "Tokens generated.", registry=None)
        self.finished_requests = Counter("veloxquant_request_finished",
                                         "Generation requests ended, by reason.", ["reason"],
                                         registry=None)
        self.rejections = Counter("veloxquant_request_rejected",
                                  "Requests turned away before running, by reason.", ["reason"],
                                  registry=None)
        self.ttft = StepHistogram("veloxquant_time_to_first_token_seconds",
                                  "Time from arrival to the first generated token.",
                                  LATENCY_BUCKETS)
        self.itl = StepHistogram("veloxquant_inter_token_latency_seconds",
                                 "Time between consecutive tokens of a request.", ITL_BUCKETS)
        self.latency = Histogram("veloxquant_request_latency_seconds",
                                 "End-to-end time of generation requests (arrival to end).",
                                 buckets=LATENCY_BUCKETS, registry=None)
        self.queue_wait = Histogram("veloxquant_queue_wait_seconds",
                                    "Time a request waited for KV capacity.",
                                    buckets=LATENCY_BUCKETS, registry=None)
        self.blocks_per_request = Histogram("veloxquant_request_kv_blocks",
                                            "Peak KV blocks held by a request.",
                                            buckets=BLOCK_BUCKETS, registry=None)
        self.per_request = ModelLabelled([
            self.prompt_tokens, self.generation_tokens, self.finished_requests, self.rejections,
            self.ttft, self.itl, self.latency, self.queue_wait, self.blocks_per_request])
        r.register(self.per_request)
        self.batch_size = Histogram("veloxquant_batch_size",
                                    "Requests decoded together per batched model call.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self._memory: dict[str, int] = {}
        self._kv: dict[str, int] = {}
        self.listeners: list[RequestEndListener] = []

    def label_model(self, model_name: Callable[[], str]) -> None:
        """Label the per-request metrics with ``model_name()``, read at each scrape."""
        self.per_request.model_name = model_name

    # -- recorded by the engine thread ---------------------------------------

    def admitted(self, waited_s: float, prompt_tokens: int) -> None:
        """A request got its reservation after waiting ``waited_s``."""
        self.queue_wait.observe(waited_s)
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, states: list[Any]) -> None:
        """One token generated for each of ``states`` (RequestStates), in one step."""
        if not states:
            return
        self.generation_tokens.inc(len(states))
        self.ttft.observe_many([s.first_token_at - s.submitted_at
                                for s in states if s.generated == 1])
        self.itl.observe_many([s.last_token_at - s.prev_token_at
                               for s in states if s.generated > 1])

    def batch_step(self, rows: int) -> None:
        """One batched decode step ran over ``rows`` requests."""
        self.batch_size.observe(rows)

    def finished(self, state: Any, reason: Any, kv_blocks: int, failure: Any = None) -> None:
        """A running request ended holding at most ``kv_blocks``.

        Args:
            state: The engine's RequestState.
            reason: Its FinishReason.
            kv_blocks: The most blocks it held.
            failure: The Reason of an ``error`` end.
        """
        self.finished_requests.labels(reason=reason.value).inc()
        self.latency.observe(time.monotonic() - state.submitted_at)
        self.blocks_per_request.observe(kv_blocks)
        for listener in self.listeners:
            listener.finished(state, reason, kv_blocks, failure)

    def rejected(self, reason: Any, request: Any, prompt_tokens: int | None = None,
                 waited_s: float | None = None) -> None:
        """A request (a GenerationRequest) was refused or dropped before running.

        ``prompt_tokens`` and ``waited_s`` (in the admission queue) where it got that far.
        """
        self.rejections.labels(reason=reason.value).inc()
        for listener in self.listeners:
            listener.rejected(request, reason, prompt_tokens, waited_s)

    def set_memory(self, snapshot: dict[str, int], kv: dict[str, int] | None = None) -> None:
        """Latest MLX allocator counters and KV bytes (sampled together by the engine thread).

        Args:
            snapshot: MLX memory by kind (active, cache, peak).
            kv: KV bytes by kind (in_use, reserved, workspace, capacity).
        """
        self._memory, self._kv = snapshot, kv or {}

    # -- recorded by the HTTP layer ------------------------------------------

    def request_done(self, endpoint: str, status: int) -> None:
        """Count one HTTP request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def unknown_fields_sent(self, endpoint: str, count: int) -> None:
        """Count ``count`` top-level fields a request to ``endpoint`` sent that it does not
        know."""
        self.unknown_fields.labels(endpoint=endpoint).inc(count)

    def memory(self) -> dict[str, int]:
        """The latest MLX memory sample (empty before the first)."""
        return dict(self._memory)

    def kv_bytes(self) -> dict[str, int]:
        """The latest KV bytes sample (empty before the first)."""
        return dict(self._kv)


# Our families that vLLM's dashboards, autoscaling rules and gateways read, and vLLM's
# names for them (counters without ``_total``, as prometheus-client names families). The
# values are the same; the histograms keep our buckets, which histogram_quantile reads
# alike. Inter-token latency and KV usage go out under older vLLM releases' names too.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "veloxquant_requests_running": ("vllm:num_requests_running",),
    "veloxquant_requests_waiting": ("vllm:num_requests_waiting",),
    "veloxquant_kv_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "veloxquant_prompt_tokens": ("vllm:prompt_tokens",),
    "veloxquant_generation_tokens": ("vllm:generation_tokens",),
    "veloxquant_request_finished": ("vllm:request_success",),
    "veloxquant_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "veloxquant_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                               "vllm:time_per_output_token_seconds"),
    "veloxquant_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "veloxquant_queue_wait_seconds": ("vllm:request_queue_time_seconds",),
}
# vLLM's finished_reason for each of our end reasons: a request whose client left is
# vLLM's "abort".
VLLM_FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort",
                         "error": "error"}


class VllmNames:
    """The families of :data:`VLLM_NAMES` again under vLLM's names (``[metrics] vllm_names``).

    Read from the same collectors at scrape time, so both names always agree and the
    engine records nothing twice.

    Args:
        metrics: The server metrics (their model-labelled per-request families).
        load_gauges: The engine collector's model-labelled load gauges
            (``EngineCollector.load_gauges``; passed in, so this module need not
            import the collectors, which import it).
    """

    def __init__(self, metrics: ServerMetrics,
                 load_gauges: Callable[[], Iterable[Metric]]) -> None:
        self.sources = (metrics.per_request.collect, load_gauges)

    def collect(self):
        for source in self.sources:
            for family in source():
                for name in VLLM_NAMES.get(family.name, ()):
                    yield vllm_family(family, name)


def vllm_family(family: Metric, name: str) -> Metric:
    """``family`` as vLLM names it: renamed samples, ``reason`` as ``finished_reason``
    with vLLM's values, and no ``_created`` samples (vLLM exports none)."""
    renamed = Metric(name, family.documentation, family.type)
    renamed.samples = [s._replace(name=name + s.name[len(family.name):],
                                  labels=_vllm_labels(s.labels))
                       for s in family.samples if not s.name.endswith("_created")]
    return renamed


def _vllm_labels(labels: dict[str, str]) -> dict[str, str]:
    if "reason" not in labels:
        return labels
    out = {key: value for key, value in labels.items() if key != "reason"}
    out["finished_reason"] = VLLM_FINISHED_REASONS.get(labels["reason"], labels["reason"])
    return out
