"""Server metrics on a private prometheus-client registry.

``/metrics`` renders this one registry. Besides the counters and histograms
the engine and the routes record, two collectors read their values at
scrape time: :class:`PoolCollector` (the pool's own counters, under the
names ``pool.stats.to_prometheus()`` uses: ``veloxquant_block_pool_*``) and
:class:`EngineCollector` (running/waiting, orphaned blocks, MLX memory, and
the engine's seconds per step phase).
The registry is private to each app, so tests can build many apps.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from veloxquant_mlx.memory.prefix_cache import CACHE_OWNER

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class StepHistogram:
    """A histogram filled a decode step at a time: one lock per step, not per token.

    The engine records a latency per generated token. prometheus-client's
    ``Histogram.observe`` takes its locks and walks the buckets in Python for
    each one; with the token counter's ``inc`` that was 244 us of every 64-row
    step on the engine thread, whose Python a GPU step waits for, and is 27 us
    now (``benchmark_scripts/benchmark_token_metrics.py``). Here a step's values
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
        self.prompt_tokens = Counter("veloxquant_prompt_tokens", "Prompt tokens admitted.",
                                     registry=r)
        self.generation_tokens = Counter("veloxquant_generation_tokens",
                                         "Tokens generated.", registry=r)
        self.finished_requests = Counter("veloxquant_request_finished",
                                         "Generation requests ended, by reason.", ["reason"],
                                         registry=r)
        self.rejections = Counter("veloxquant_request_rejected",
                                  "Requests turned away before running, by reason.", ["reason"],
                                  registry=r)
        self.ttft = StepHistogram("veloxquant_time_to_first_token_seconds",
                                  "Time from arrival to the first generated token.",
                                  LATENCY_BUCKETS)
        self.itl = StepHistogram("veloxquant_inter_token_latency_seconds",
                                 "Time between consecutive tokens of a request.", ITL_BUCKETS)
        r.register(self.ttft)
        r.register(self.itl)
        self.latency = Histogram("veloxquant_request_latency_seconds",
                                 "End-to-end time of generation requests (arrival to end).",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("veloxquant_queue_wait_seconds",
                                    "Time a request waited for KV capacity.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.blocks_per_request = Histogram("veloxquant_request_kv_blocks",
                                            "Peak KV blocks held by a request.",
                                            buckets=BLOCK_BUCKETS, registry=r)
        self.batch_size = Histogram("veloxquant_batch_size",
                                    "Requests decoded together per batched model call.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self._memory: dict[str, int] = {}
        self._kv: dict[str, int] = {}
        self.listeners: list[RequestEndListener] = []

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
        running, waiting = self.engine.queue_depths()
        yield _gauge("veloxquant_requests_running", "Requests generating now.", running)
        yield _gauge("veloxquant_requests_waiting", "Requests waiting for KV capacity.", waiting)
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
        clock = getattr(self.engine, "clock", None)  # test doubles may have none
        if clock is not None:
            yield from _step_families(clock)
        kv = getattr(self.engine, "kv", None)  # the arena, once a model is loaded
        if kv is not None:
            yield CounterMetricFamily("veloxquant_kv_arena_writes",
                                      "Scatters of new keys and values into the KV arena (on a "
                                      "GPU each copies the whole arena).", value=kv.arena.writes)
        yield from _cache_families(getattr(self.engine, "prefix_cache", None))


def _cache_families(cache: Any):
    """Prefix caching: cached and evictable blocks, evictions, hit and query tokens.

    All zero with prefix caching off, so dashboards and alerts see the same names.
    """
    counters = cache.counters if cache is not None else None
    yield _gauge("veloxquant_block_pool_cached_blocks",
                 "Blocks the prefix cache holds (not counted in blocks_in_use).",
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
    """The engine's time per step phase (server.engine.step_clock) and its decode steps."""
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


def orphaned_blocks(pool: Any, live_requests: Callable[[], dict[int, str]]) -> int:
    """Blocks held by owners that no live request accounts for.

    Reads the pool's owners before the live set: an owner that ends in between
    has already freed its blocks, so it adds 0 and never counts as an orphan.
    The prefix cache's owner is a known one (its blocks are reported apart).
    """
    owners = pool.active_owners()
    live = live_requests()
    return sum(pool.n_blocks_held(o) for o in owners if o not in live and o != CACHE_OWNER)


def request_blocks_in_use(pool: Any, stats: dict[str, Any]) -> int:
    """Blocks requests hold: the pool's blocks in use less the prefix cache's."""
    return stats["blocks_in_use"] - pool.n_blocks_held(CACHE_OWNER)


# The families AllocationStats.to_prometheus() writes, in its order:
# (name after the prefix, kind, help, AllocationStats.as_dict() key).
POOL_FAMILIES = (
    ("blocks_in_use", "gauge", "Blocks currently checked out", "blocks_in_use"),
    ("blocks_total", "gauge", "Blocks the pool manages", "n_blocks"),
    ("fragmentation", "gauge", "Share of blocks allocated but not full", "fragmentation"),
    ("peak_blocks_in_use", "gauge",
     "High-water mark of blocks checked out, the prefix cache's included", "peak_blocks_in_use"),
    ("allocations_total", "counter", "Blocks handed out", "n_allocations"),
    ("frees_total", "counter", "Blocks returned", "n_frees"),
    ("reused_total", "counter", "Blocks handed out again after a free", "n_reused"),
    ("exhausted_total", "counter", "Failed allocate() calls (pool exhausted)", "n_exhausted"),
    ("grown_total", "counter", "Blocks added by growth", "n_grown"),
    ("retired_total", "counter", "Blocks removed by shrink", "n_retired"),
)


class PoolCollector:
    """The pool's counters, read from one consistent stats snapshot per scrape.

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
        stats = pool.stats.snapshot().as_dict()
        # Cached prefix blocks are shown apart (veloxquant_block_pool_cached_blocks):
        # an idle server reads 0 in use even while it keeps a warm cache.
        stats["blocks_in_use"] = request_blocks_in_use(pool, stats)
        for name, kind, doc, key in POOL_FAMILIES:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"{self.prefix}_{name}", doc, value=stats[key])
