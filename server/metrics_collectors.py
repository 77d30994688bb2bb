"""The collectors ``/metrics`` reads at scrape time, beside :mod:`server.metrics`'s recorded ones.

:class:`PoolCollector` passes on the pool's own counters, under the names
``pool.stats.to_prometheus()`` uses (``veloxquant_block_pool_*``); :class:`EngineCollector`
reads running/waiting, orphaned blocks, MLX memory, the prefix and grammar caches and the
engine's seconds per step phase. Nothing here is recorded by the engine thread: every value
is read when a scrape asks, so it costs the hot path nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import MODEL_LABEL, ServerMetrics


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
