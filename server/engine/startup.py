"""Building the engine's parts once the model is loaded (engine thread).

The pool is sized from the model's KV layout (``pool.kv_memory``), so the
scheduler, the runner and the prompt workers can only be built after the
load. :func:`assemble` does that in order and logs the start-up lines that
say what the server computes with; :class:`~server.engine.engine.Engine`
takes the parts and starts its loop.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.engine.kv_memory import (
    KVMemory,
    PromptPrefixes,
    blocks_for_bytes,
    blocks_for_longest_request,
    build_kv_memory,
    cache_root,
    kv_format_of,
    longest_request,
)
from server.engine.kv_memory import describe as describe_kv
from server.engine.run_output import StepClock
from server.engine.runner import ModelRunner
from server.engine.scheduler import Scheduler
from server.engine.steps import OutputProcessor
from server.metrics import ServerMetrics
from server.model_loader import LoadedModel
from server.pool_fit import (
    arena_problem,
    device_memory_bytes,
)
from server.settings import LimitsSection, Settings
from server.text.prompts import PromptPreparer
from veloxquant_mlx.blas_status import describe_backend
from veloxquant_mlx.codes_linear import INT8_MAX_ROWS
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_arena import KVLayout, probe_kv_layout

log = logging.getLogger("veloxquant.server")


def make_pool(settings: Settings, n_blocks: int | None = None) -> BlockPoolAllocator:
    """Build the shared pool from the ``[pool]`` settings (``n_blocks`` overrides them)."""
    p = settings.pool
    return BlockPoolAllocator(
        PoolConfig(
            block_size=p.block_size,
            n_blocks=n_blocks or p.n_blocks,
            separate_kv=p.separate_kv,
            grow_on_exhaustion=p.grow_on_exhaustion,
            max_blocks=p.max_blocks or None,
        )
    )


def events_at_submit(settings: Settings) -> bool:
    """Whether a step's events wait for the next decode's submit (``batch.events_at_submit``).

    ``auto`` is on where the model runs on a GPU: from the submit on, the engine
    thread waits for the device and the host's cores are idle, so the event
    loop streams the tokens for free. On the CPU backend the same wait is the
    model computing on those cores, and the loop's work would slow it down
    (``figures/server/events_at_submit_ab*.json``: 3 ms less engine host work a
    step, 5 ms more compute, on 2 cores).
    """
    choice = settings.batch.events_at_submit
    if choice == "auto":
        return on_gpu()
    return bool(choice)


def prefill_time_slice(settings: Settings) -> float:
    """Seconds a step's prefill may take while requests decode (0: no time bound).

    ``batch.max_prefill_s_per_step`` on the CPU backend, where a prefill chunk
    runs as it is handed over and its time is what the running streams wait.
    On a GPU chunks are queued without waiting (their measured time would be the
    host's, and a queue that blocks would cut chunks for nothing), so the token
    bound alone holds there.
    """
    return 0.0 if on_gpu() else settings.batch.max_prefill_s_per_step


def on_gpu() -> bool:
    """The model runs on a GPU: model calls queue there while the host goes on. On the
    CPU backend a call runs on the cores the host would use, so the engine waits
    for it rather than overlapping (first tokens read at once, events at once,
    prefill cut by time)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def _refuse_a_pool_that_holds_no_request(scheduler: Scheduler, pool: BlockPoolAllocator) -> None:
    """Stop start-up when not even a 1-token prompt with ``max_tokens`` 1 fits the pool.

    Such a server would come up healthy and refuse every request.

    Raises:
        ValueError: Saying how many blocks the smallest request needs.
    """
    most = scheduler.planner.max_request_tokens()
    if most is not None and most < 2:
        need = scheduler.planner.reservation(2)
        raise ValueError(
            f"the KV pool ({pool.stats.n_blocks} blocks) holds no request: the smallest (a "
            f"1-token prompt, max_tokens 1) needs {need.total} blocks, one a layer on each "
            f"stream ({', '.join(need.per_stream)}); raise pool.n_blocks")


def _warn_if_default_requests_never_fit(scheduler: Scheduler, default_max_tokens: int) -> None:
    """Say at start-up when a one-token prompt with the default ``max_tokens`` cannot fit.

    Such a server lowers the ``max_tokens`` of every request that leaves it out to what
    the pool holds; a sizing mistake worth one line in the log before clients meet it.
    """
    n_tokens = 1 + default_max_tokens
    misfit = scheduler.planner.never_fits(scheduler.planner.reservation(n_tokens), n_tokens)
    if misfit is not None:
        log.warning("the KV pool cannot hold a request that leaves max_tokens out "
                    "(limits.default_max_tokens=%d): such requests get at most %s tokens, "
                    "prompt included (%d tokens need %d KV blocks on stream %r, the pool "
                    "holds at most %d there)", default_max_tokens,
                    scheduler.planner.max_request_tokens(), misfit.n_tokens, misfit.blocks,
                    misfit.stream, misfit.have)


def _warn_if_the_context_never_fits(scheduler: Scheduler, limits: LimitsSection,
                                    context: int | None) -> None:
    """Say at start-up when the pool holds less than the longest request the limits and the
    served context allow: clients read ``max_model_len`` and would meet a 400 instead."""
    longest = longest_request(limits, context)
    most = scheduler.planner.max_request_tokens()
    if most is not None and most < longest:
        log.warning("the KV pool holds at most %d tokens a request (prompt + max_tokens), less "
                    "than the %d the limits and the served context allow: longer requests get "
                    "a 400; raise pool.n_blocks or pool.kv_memory", most, longest)


def apply_context_limit(limits: LimitsSection, loaded: LoadedModel) -> None:
    """Set ``loaded.context_length`` from ``limits.max_context_tokens`` (0: the model's).

    A value above what the model states is the operator's call (a checkpoint whose
    config understates it, say), so it is taken, with a warning.
    """
    chosen, stated = limits.max_context_tokens, loaded.context_length
    if not chosen:
        return
    if stated is not None and chosen > stated:
        log.warning("limits.max_context_tokens=%d is over the %d positions the model states "
                    "(max_position_embeddings): past those its output is unreliable",
                    chosen, stated)
    loaded.context_length, loaded.context_configured = chosen, True


def plan_kv(settings: Settings, layout: KVLayout, pool: BlockPoolAllocator | None = None,
            context: int | None = None) -> tuple[BlockPoolAllocator, KVMemory]:
    """The pool sized from ``pool.kv_memory`` (if set; else ``pool``, or a new one from
    ``[pool]``) and its KV arena, whose workspace bound counts rows of at most ``context``
    tokens. Call before anything holds blocks."""
    import mlx.core as mx

    device_memory = device_memory_bytes(mx)
    blocks = blocks_for_bytes(settings, layout)
    if blocks is None:
        blocks = blocks_for_longest_request(settings, layout, context, device_memory)
        if blocks is not None:
            log.info("the default KV pool (pool.n_blocks = %d) grows to %d blocks to hold one "
                     "request of the served context", settings.pool.n_blocks, blocks)
    n_blocks = blocks or (pool.config.n_blocks if pool is not None else settings.pool.n_blocks)
    problem = arena_problem(settings, n_blocks, layout.bytes_per_block(settings.pool.block_size),
                            device_memory)
    if problem is not None:  # before anything is allocated
        raise ValueError(problem)
    if blocks is not None or pool is None:
        pool = make_pool(settings, blocks)
    return pool, build_kv_memory(settings, pool, layout, context)


@dataclass(slots=True)
class EngineParts:
    """What the engine runs with, built around one loaded model."""

    loaded: LoadedModel
    pool: BlockPoolAllocator
    kv: KVMemory
    prefixes: PromptPrefixes
    scheduler: Scheduler
    runner: Any  # a ModelRunner, or the distributed LeaderRunner around one
    output: OutputProcessor
    preparer: PromptPreparer


def assemble(settings: Settings, pool: BlockPoolAllocator,
             loader: Callable[[Any], LoadedModel], metrics: ServerMetrics, clock: StepClock,
             deliver: Callable[[Any, list[int]], None]) -> EngineParts:
    """Load the model and build the parts around it; ``deliver`` takes each tokenized
    request and its prompt ids (from the preparer's worker threads).

    ``pool`` is used as is unless ``pool.kv_memory`` sizes a new one. With
    ``distributed.ranks > 1`` this is rank 0: it joins the group, shards the
    weights and wraps its runner so the other ranks repeat its calls.

    Raises:
        Exception: Whatever the load or a part's construction raised.
    """
    group = None
    if settings.distributed.ranks > 1:  # rank 0 of a split model
        from server.distributed import join_group

        group = join_group(settings.distributed.ranks)
    # A split model stays in mlx-lm's layer classes, which its split takes (load_model).
    loaded = loader(settings.model) if group is None else loader(settings.model, codes=False)
    apply_context_limit(settings.limits, loaded)
    if group is not None:
        from server.distributed import shard_loaded

        shard_loaded(loaded, group)
    layout = probe_kv_layout(loaded.model, kv_format_of(settings))
    pool, kv = plan_kv(settings, layout, pool, loaded.context_length)
    prefixes = _prompt_prefixes(settings, loaded, pool, kv)
    scheduler = Scheduler(settings, pool, loaded, metrics, prefixes)
    _refuse_a_pool_that_holds_no_request(scheduler, pool)
    _warn_if_default_requests_never_fit(scheduler, settings.limits.default_max_tokens)
    _warn_if_the_context_never_fits(scheduler, settings.limits, loaded.context_length)
    batch = settings.batch
    runner = ModelRunner(loaded.model, pool, batch.prefill_chunk_size, kv.arena, clock,
                         prefixes, batch.kv_write_back, batch.compile_decode,
                         fuse_projections=batch.fuse_projections,
                         first_tokens_at_once=not on_gpu())
    compiled = runner.compiled_blocks
    if group is not None:  # the other ranks repeat this runner's calls
        from server.distributed import (
            LeaderRunner,
            RankLink,
        )

        runner = LeaderRunner(runner, RankLink(group))
    parts = EngineParts(loaded, pool, kv, prefixes, scheduler, runner,
                        OutputProcessor(loaded.tokenizer),
                        PromptPreparer(loaded, settings.limits, metrics, deliver,
                                       settings.batch.max_batch_size))
    _log_what_serves(loaded, compiled, kv, pool, layout)
    return parts


def _prompt_prefixes(settings: Settings, loaded: LoadedModel, pool: BlockPoolAllocator,
                     kv: KVMemory) -> PromptPrefixes:
    """Prefix caching over the pool's cached blocks, keyed to this model and KV arena."""
    # A hit leaves the int8 row range behind it (PromptPrefixes' min_tail).
    codes_rows = INT8_MAX_ROWS if loaded.codes_layers else 0
    return PromptPrefixes(pool.prefix_cache, cache_root(loaded.name, kv.arena),
                          pool.config.block_size, min_tail=codes_rows + 1,
                          enabled=settings.cache.prefix_caching)


def _log_what_serves(loaded: LoadedModel, compiled: int, kv: KVMemory,
                     pool: BlockPoolAllocator, layout: KVLayout) -> None:
    """The start-up lines that say what the server computes with: the model, the backend
    and the decode path; then the KV pool (blocks, bytes per block, workspace)."""
    log.info("model %s loaded (%d layers; context %s tokens; %s); backend: %s; decode: %s",
             loaded.name, loaded.n_layers, loaded.context_length or "unbounded",
             loaded.weights or "weights as stored",
             describe_backend(loaded.dtype),
             f"{compiled} of {loaded.n_layers} blocks compiled" if compiled
             else "blocks as mlx-lm runs them")
    log.info("%s", describe_kv(kv, pool, layout))


def release_thread_streams() -> None:
    """Free this thread's MLX streams before the thread ends (all MLX work here is done).

    MLX keeps per-thread state (command encoders, compile caches); left to the
    thread's own teardown it can crash the process on MLX's CUDA backend (MLX
    issues #4327, #4506), so the engine thread hands it back explicitly.
    """
    import mlx.core as mx

    mx.synchronize()
    if hasattr(mx, "clear_streams"):
        mx.clear_streams()


def serve_follower(settings: Any) -> int:
    """A follower process's whole life: join the ring, load and shard the model, then
    :func:`follow`."""
    from server.distributed import (
        LeaderWait,
        RankLink,
        follow,
        join_group,
        open_sockets,
        shard_loaded,
    )
    from server.model_loader import load_model

    before = open_sockets()
    group = join_group(settings.distributed.ranks)
    wait = LeaderWait(open_sockets() - before)
    loaded = load_model(settings.model, codes=False)
    apply_context_limit(settings.limits, loaded)
    shard_loaded(loaded, group)
    layout = probe_kv_layout(loaded.model, kv_format_of(settings))
    pool, kv = plan_kv(settings, layout, context=loaded.context_length)
    runner = ModelRunner(loaded.model, pool, settings.batch.prefill_chunk_size, kv.arena,
                         kv_write_back=settings.batch.kv_write_back,
                         compile_decode=settings.batch.compile_decode,
                         fuse_projections=settings.batch.fuse_projections,
                         first_tokens_at_once=not on_gpu())
    log.info("rank %d of %d: following rank 0 (%s)", group.rank(), group.size(), loaded.name)
    follow(runner, RankLink(group), wait)
    wait.close()
    log.info("rank %d: rank 0 stopped; exiting", group.rank())
    sys.stdout.flush()
    return 0
