"""Server metrics on a private prometheus-client registry.

``/metrics`` renders this one registry. Besides the counters and histograms
the engine and the routes record, two collectors read their values at
scrape time: :class:`PoolCollector` (the pool's own counters, under the
names ``pool.stats.to_prometheus()`` uses: ``veloxquant_block_pool_*``) and
:class:`EngineCollector` (running/waiting, orphaned blocks, MLX memory, and
the engine's seconds per step phase).
The per-request metrics and the load gauges carry the served model's name as
``model_name`` (:class:`ModelLabelled`); with ``[metrics] vllm_names`` they also go
out under vLLM's names (:class:`VllmNames`).
The registry is private to each app, so tests can build many apps.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
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


class EngineCollector:
    """Scrape-time gauges read from the engine and the pool.

    Args:
        engine: The engine (real or fake) exposing ``pool``, ``live_requests()``
            and ``queue_depths()``.
        metrics: Where the MLX memory sample lives.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    def collect(self):
        yield from self.load_gauges()
        yield _gauge("veloxquant_orphaned_blocks",
                     "Blocks held by pool owners with no live request (should be 0).",
                     orphaned_blocks(self.engine.pool, self.engine.live_requests))
        mem = GaugeMetricFamily("veloxquant_mlx_memory_bytes",
                                "MLX allocator memory by kind (active, cache, peak).",
                                labels=["kind"])
        for kind, value in sorted(self.metrics.memory().items()):
            mem.add_metric([kind], value)
        yield mem
        kv = GaugeMetricFamily("veloxquant_kv_bytes",
                               "KV bytes: pool blocks in use, reserved by admission, the fixed "
                               "transient workspace, pool capacity.", labels=["kind"])
        for kind, value in sorted(self.metrics.kv_bytes().items()):
            kv.add_metric([kind], value)
        yield kv
        loaded = getattr(self.engine, "loaded", None)  # test doubles may have none
        if loaded is not None:
            yield _model_gauge("veloxquant_model_weight_bytes",
                               "Bytes the served model's parameters hold (quantized codes, "
                               "scales and float parameters).", loaded.weight_bytes,
                               loaded.name)
        clock = getattr(self.engine, "clock", None)  # test doubles may have none
        if clock is not None:
            yield from _step_families(clock)
        kv = getattr(self.engine, "kv", None)  # the arena, once a model is loaded
        if kv is not None:
            yield CounterMetricFamily("veloxquant_kv_arena_writes",
                                      "Scatters of new keys and values into the KV arena (on a "
                                      "GPU each copies the whole arena).", value=kv.arena.writes)
        yield from _cache_families(getattr(self.engine, "prefix_cache", None))
        yield from _grammar_families(getattr(self.engine, "grammars", None))


    def load_gauges(self):
        """Requests running and waiting and the KV usage ratio, labelled with the served
        model's name (what autoscalers and gateways read to pick and size replicas)."""
        model = self.engine.model_name
        running, waiting = self.engine.queue_depths()
        yield _model_gauge("veloxquant_requests_running", "Requests generating now.",
                           running, model)
        yield _model_gauge("veloxquant_requests_waiting", "Requests waiting for KV capacity.",
                           waiting, model)
        yield _model_gauge("veloxquant_kv_usage_ratio",
                           "Share of the pool's blocks admission cannot hand out: held by "
                           "requests, or cached and referenced by one (0..1).",
                           kv_usage_ratio(self.engine.pool,
                                          getattr(self.engine, "prefix_cache", None)), model)


def kv_usage_ratio(pool: Any, cache: Any) -> float:
    """The share of the pool's blocks that are not free for admission, 0..1.

    Blocks in use (the prefix cache's included) less the cached blocks no request
    references, which admission evicts when it needs them; vLLM's ``kv_cache_usage_perc``
    counts the same way (its unreferenced cached blocks sit in the free queue).

    Args:
        pool: The shared pool.
        cache: The prefix cache (its ``evictable_blocks``), or None with caching off.
    """
    stats = pool.stats.snapshot().as_dict()
    evictable = cache.evictable_blocks if cache is not None else 0
    return (stats["blocks_in_use"] - evictable) / stats["n_blocks"]


def _grammar_families(cache: Any):
    """The compiled-grammar cache (server.text.schemas.GrammarCache): its estimated
    bytes, bounded by ``limits.grammar_cache_bytes``, and its entries (0 without one)."""
    yield _gauge("veloxquant_grammar_cache_bytes",
                 "Estimated bytes of the compiled structured-output grammars kept.",
                 cache.bytes if cache is not None else 0)
    yield _gauge("veloxquant_grammar_cache_entries",
                 "Compiled structured-output grammars kept.",
                 cache.entries if cache is not None else 0)


def _cache_families(cache: Any):
    """Prefix caching: cached and evictable blocks, evictions, hit and query tokens.

    All zero with prefix caching off, so dashboards and alerts see the same names.
    """
    counters = cache.counters if cache is not None else None
    yield _gauge("veloxquant_block_pool_cached_blocks",
                 "Blocks the prefix cache holds (in blocks_in_use, not in "
                 "request_blocks_in_use).",
                 cache.cached_blocks if cache is not None else 0)
    yield _gauge("veloxquant_block_pool_evictable_blocks",
                 "Cached blocks no request references: free for admission, evicted LRU.",
                 cache.evictable_blocks if cache is not None else 0)
    yield CounterMetricFamily("veloxquant_block_pool_evictions",
                              "Cached blocks evicted (freed) to make room or by a reset.",
                              value=counters.evicted_blocks if counters else 0)
    yield CounterMetricFamily("veloxquant_prefix_cache_query_tokens",
                              "Prompt tokens looked up in the prefix cache.",
                              value=counters.query_tokens if counters else 0)
    yield CounterMetricFamily("veloxquant_prefix_cache_hit_tokens",
                              "Prompt tokens served from cached blocks (not computed).",
                              value=counters.hit_tokens if counters else 0)


def _step_families(clock: Any):
    """The engine's time per step phase (server.engine.run_output) and its decode steps."""
    steps, seconds = clock.totals()
    phases = CounterMetricFamily("veloxquant_engine_phase_seconds",
                                 "Engine-thread seconds by step phase (differences between "
                                 "scrapes over decode steps: where a step's time goes).",
                                 labels=["phase"])
    for phase, value in seconds.items():
        phases.add_metric([phase], value)
    yield phases
    yield CounterMetricFamily("veloxquant_engine_decode_steps",
                              "Batched decode model calls run.", value=steps)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _model_gauge(name: str, doc: str, value: float, model: str) -> GaugeMetricFamily:
    """A gauge labelled ``model_name`` (unlabelled before the model loads, as
    :class:`ModelLabelled` has it)."""
    if not model:
        return _gauge(name, doc, value)
    family = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
    family.add_metric([model], value)
    return family


def orphaned_blocks(pool: Any, live_requests: Callable[[], dict[int, str]]) -> int:
    """Blocks held by owners that no live request accounts for.

    Reads the pool's owners before the live set: an owner that ends in between
    has already freed its blocks, so it adds 0 and never counts as an orphan.
    The prefix cache's blocks are no owner's (they are reported apart).
    """
    owners = pool.active_owners()
    live = live_requests()
    return sum(pool.n_blocks_held(o) for o in owners if o not in live)


def request_blocks_in_use(pool: Any, blocks_in_use: int) -> int:
    """Blocks requests hold: the pool's ``blocks_in_use`` less the prefix cache's blocks."""
    return blocks_in_use - pool.prefix_cache.cached_blocks


class PoolCollector:
    """The pool's counters, read from one consistent stats snapshot per scrape.

    The pool's families are what ``AllocationStats.to_prometheus()`` writes for that
    snapshot, parsed and passed on unchanged: ``blocks_in_use`` is ``allocations -
    frees``, the prefix cache's blocks included (they are allocated). Requests' own
    share follows as ``<prefix>_request_blocks_in_use`` (0 on an idle server even while
    it keeps a warm cache; ``veloxquant_block_pool_cached_blocks`` is the rest).

    Args:
        pool: The shared pool (anything with ``stats.snapshot()``), or a
            function returning it (the engine sizes its pool once the model loads).
        prefix: Metric name prefix, as ``AllocationStats.to_prometheus`` takes it.
    """

    def __init__(self, pool: Any, prefix: str = "veloxquant_block_pool") -> None:
        self.pool = pool
        self.prefix = prefix

    def collect(self):
        pool = self.pool() if callable(self.pool) else self.pool
        snapshot = pool.stats.snapshot()
        yield from text_string_to_metric_families(snapshot.to_prometheus(self.prefix))
        yield _gauge(f"{self.prefix}_request_blocks_in_use",
                     "Blocks requests hold: blocks_in_use less the prefix cache's",
                     request_blocks_in_use(pool, snapshot.blocks_in_use()))


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
        gauges: The engine collector (its model-labelled load gauges).
    """

    def __init__(self, metrics: ServerMetrics, gauges: EngineCollector) -> None:
        self.sources = (metrics.per_request.collect, gauges.load_gauges)

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
