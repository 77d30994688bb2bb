"""The generation engine: the one thread that owns the model and all MLX work.

Routes call :meth:`Engine.submit` (thread-safe, non-blocking); the engine
thread answers through each request's
:class:`~server.engine.protocol.EventChannel`. One loop, one thread::

    while running:
        intake   inbox (prompts tokenized by worker threads, server.engine.preparer)
                 -> scheduler.intake (refused, or waiting)
        step()   schedule: expire waiting requests, admit what fits (scheduler)
                 run:      prefill new requests within the step's token budget,
                           then decode every running request in ONE model call (runner)
                 postprocess: detokenize, stop strings, limits, events (output);
                           finished requests leave the runner and are released

Every exit path (done, stop, length, model error, cancellation, shutdown)
goes through :meth:`Engine._end`, in the step that ended the request: its
rows leave the runner (blocks back to the pool), then the scheduler retires
its owner, then the client hears.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.engine.kv_memory import KVMemory, blocks_for_bytes, build_kv_memory, kv_format_of
from server.engine.kv_memory import describe as describe_kv
from server.engine.output import OutputProcessor
from server.engine.prefix import PromptPrefixes, cache_root
from server.engine.preparer import Prepared, PromptPreparer
from server.engine.protocol import (
    Admitted,
    EventBatch,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Reason,
    Rejected,
    Usage,
)
from server.engine.request_state import RequestState
from server.engine.runner import ModelRunner, RunOutput, memory_snapshot
from server.engine.sampling import reset_random_state
from server.engine.scheduler import Scheduler
from server.engine.scoring import ScoringJob, new_job
from server.engine.step_clock import StepClock
from server.metrics import ServerMetrics
from server.model_loader import LoadedModel, load_model
from server.settings import Settings
from veloxquant_mlx.cpu_backend import describe_backend
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_arena import KVLayout, probe_kv_layout
from veloxquant_mlx.memory.prefix_cache import PrefixCache

log = logging.getLogger("veloxquant.server")

# Called on the engine thread with a request's state right before each model
# call of that request; raising fails that request only (fault injection in tests).
FaultHook = Callable[[RequestState], None]

SHUTTING_DOWN = "the server is shutting down"


@dataclass(slots=True)
class _Command:
    """Work to run on the engine thread between steps (admin operations)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


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


def plan_kv(settings: Settings, layout: KVLayout,
            pool: BlockPoolAllocator | None = None) -> tuple[BlockPoolAllocator, KVMemory]:
    """The pool sized from ``pool.kv_memory`` (if set; else ``pool``, or a new one from
    ``[pool]``) and its KV arena. Call before anything holds blocks."""
    blocks = blocks_for_bytes(settings, layout)
    if blocks is not None or pool is None:
        pool = make_pool(settings, blocks)
    return pool, build_kv_memory(settings, pool, layout)


class Engine:
    """Owns the model thread, the scheduler, the runner and the shared pool.

    Args:
        settings: Server settings.
        metrics: Where to record request metrics (a private registry).
        loader: Loads the model on the engine thread (tests may pass their own).
        fault_hook: Optional per-step hook, see :data:`FaultHook`.
    """

    def __init__(
        self,
        settings: Settings,
        metrics: ServerMetrics | None = None,
        *,
        loader: Callable[[Any], LoadedModel] = load_model,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.settings = settings
        self.pool = make_pool(settings)
        self.metrics = metrics or ServerMetrics()
        self._loader = loader
        self.fault_hook = fault_hook
        self._inbox: queue.SimpleQueue[Prepared | _Command | None] = queue.SimpleQueue()
        self._preparer: PromptPreparer | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self.scheduler: Scheduler | None = None
        self.runner: ModelRunner | None = None
        self.output: OutputProcessor | None = None
        self.kv: KVMemory | None = None  # the arena and byte figures, once the model is loaded
        self.prefixes: PromptPrefixes | None = None  # prefix caching, once the model is loaded
        self.clock = StepClock()  # where step time goes (/metrics)
        self._events = EventBatch()  # a step's token events, sent together

    # -- lifecycle (any thread) -----------------------------------------------

    def start(self) -> None:
        """Start the engine thread; the model loads on it."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="veloxquant-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (or failed to); True when ready."""
        self._ready.wait(timeout)
        return self.is_ready

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; running and waiting requests are told the server is stopping."""
        self._stopping.set()
        self._inbox.put(None)  # wake an idle loop
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        """Model loaded and the engine thread alive and not stopping."""
        return (
            self.loaded is not None
            and self._thread is not None
            and self._thread.is_alive()
            and not self._stopping.is_set()
        )

    @property
    def model_name(self) -> str:
        """The served model id (empty before load)."""
        return self.loaded.name if self.loaded else ""

    def submit(self, request: GenerationRequest) -> None:
        """Hand a request to the prompt workers, then the engine thread (never blocks)."""
        preparer = self._preparer
        if preparer is None:
            request.channel.put(Rejected(Reason.SHUTTING_DOWN, "the model is not loaded"))
            return
        preparer.submit(request)

    def run_on_engine(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two steps; returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Command(fn, future))
        return future

    def compile_constraint(self, response_format: dict[str, Any] | None = None,
                           schema: dict[str, Any] | None = None, *, name: str = "schema",
                           param: str = "response_format") -> Any:
        """The grammar for a ``response_format``, or for a JSON ``schema`` (tool calls).

        Blocks for the first schema of a model (~0.4 s: llguidance's token
        index); call it from a worker thread. Cached, thread-safe
        (:mod:`server.engine.constraints`).

        Returns:
            The compiled constraint for ``SamplingParams.constraint``, or None
            when the output is free text.

        Raises:
            ConstraintError: The format or schema cannot be enforced (a 400).
        """
        from server.engine.constraints import compile_json_schema, compile_response_format

        tokenizer = self.loaded.tokenizer
        if schema is not None:
            return compile_json_schema(schema, tokenizer, name=name, param=param)
        return compile_response_format(response_format, tokenizer)

    def prompt_scorer(self, prompt: str | list[int],
                      top_n: int | None) -> ScoringJob | Rejected:
        """A job scoring ``prompt``'s own tokens (completions ``echo``), or its refusal.

        Tokenizes, so it blocks: call it from a worker thread. Run the job's
        ``step`` through :meth:`run_on_engine` until it is ``done`` (one chunk
        per call, so running requests decode in between; server.engine.scoring).
        """
        loaded = self.loaded
        if loaded is None:
            return Rejected(Reason.SHUTTING_DOWN, "the model is not loaded")
        if self.settings.distributed.ranks > 1:  # a model call only rank 0 would make
            return Rejected(Reason.INVALID_VALUE, "echo and prompt logprobs are not "
                            "available while the model is split over ranks "
                            "(distributed.ranks > 1)")
        return new_job(loaded, self.settings.limits.max_prompt_tokens,
                       self.settings.batch.prefill_chunk_size, prompt, top_n)

    def shrink(self, stream: str, target_free: int,
               force: bool = False) -> concurrent.futures.Future:
        """Retire free blocks, never below what running requests have reserved.

        Runs on the engine thread so no admission happens in between. A
        shrink that would leave the pool unable to hold one maximal request
        (``limits.max_prompt_tokens + limits.max_tokens_cap``) is refused
        unless ``force``; after a forced one :attr:`degraded` says why.

        Args:
            stream: "k", "v" or "kv" ("kv" on a split pool shrinks both).
            target_free: Free blocks to leave per stream.
            force: Shrink even below one maximal request.

        Returns:
            A future of ``(retired, kept_free)``: blocks retired and, per
            stream, the free blocks left. It raises
            :class:`~server.engine.protocol.ShrinkRefused`.
        """
        return self.run_on_engine(lambda: self._shrink(stream, target_free, force))

    def _shrink(self, stream: str, target_free: int,
                force: bool) -> tuple[int, dict[str, int]]:
        retired, kept = self.scheduler.shrink(stream, target_free, force)
        if self.scheduler.degraded:
            log.warning("forced shrink: %s", self.scheduler.degraded)
        return retired, kept

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Drop every cached block no request references (on the engine thread).

        Returns:
            A future of the number of blocks freed (0 with prefix caching off).
        """
        return self.run_on_engine(self.scheduler.reset_cache)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The pool's prefix cache (None: prefix caching off, or the model not loaded)."""
        return self.prefixes.cache if self.prefixes is not None else None

    @property
    def degraded(self) -> str | None:
        """Why the server cannot serve every valid request any more (a forced shrink), else None."""
        return self.scheduler.degraded if self.scheduler else None

    def rank_figures(self) -> concurrent.futures.Future | None:
        """Every rank's pool figures (a future), when the model is split over ranks; else None."""
        runner = self.runner
        if runner is None or not hasattr(runner, "rank_figures"):
            return None
        if not self.is_ready:  # no loop to run the exchange
            stopped: concurrent.futures.Future = concurrent.futures.Future()
            stopped.set_exception(RuntimeError("the engine is not running"))
            return stopped
        return self.run_on_engine(runner.rank_figures)

    def live_requests(self) -> dict[int, str]:
        """Owner id -> request id of every request holding (or about to hold) blocks."""
        return self.scheduler.live_requests() if self.scheduler else {}

    def queue_depths(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return self.scheduler.depths() if self.scheduler else (0, 0)

    # -- the loop (engine thread) ---------------------------------------------

    def _run(self) -> None:
        try:
            if not self._load():
                return
            try:
                while not self._stopping.is_set():
                    idle = not self.scheduler.running
                    self._intake(timeout=0.05 if idle else 0.0)
                    self.step()
                    self._sample_memory(force=idle)
                    self.clock.lap("memory")
            except Exception:  # a bug in the loop itself: fail everything cleanly
                log.exception("engine loop crashed")
                self._stopping.set()  # not ready from now on: /health says 503
            finally:
                self._shutdown()
        finally:
            release_thread_streams()

    def _load(self) -> bool:
        try:
            group = None
            if self.settings.distributed.ranks > 1:  # rank 0 of a split model
                from server.engine.distributed import join_group

                group = join_group(self.settings.distributed.ranks)
            loaded = self._loader(self.settings.model)
            if group is not None:
                from server.engine.distributed import shard_loaded

                shard_loaded(loaded, group)
            layout = probe_kv_layout(loaded.model, kv_format_of(self.settings))
            self.pool, self.kv = plan_kv(self.settings, layout, self.pool)
            if self.settings.cache.prefix_caching:
                self.prefixes = PromptPrefixes(PrefixCache(self.pool),
                                               cache_root(loaded.name, self.kv.arena),
                                               self.pool.config.block_size)
            self.scheduler = Scheduler(self.settings, self.pool, loaded, self.metrics,
                                       self.prefixes)
            self.runner = ModelRunner(loaded.model, self.pool,
                                      self.settings.batch.prefill_chunk_size, self.kv.arena,
                                      self.clock, self.prefixes,
                                      self.settings.batch.kv_write_back,
                                      self.settings.batch.compile_decode)
            compiled = self.runner.compiled_blocks
            if group is not None:  # the other ranks repeat this runner's calls
                from server.engine.distributed import LeaderRunner, RankLink

                self.runner = LeaderRunner(self.runner, RankLink(group))
            self.output = OutputProcessor(loaded.tokenizer)
            self._preparer = PromptPreparer(loaded, self.settings.limits, self.metrics,
                                            self._inbox.put)
            self.loaded = loaded
            # The one start-up line that says what the server computes with.
            log.info("model %s loaded (%d layers; %s); backend: %s; decode: %s", loaded.name,
                     loaded.n_layers, loaded.weights or "weights as stored",
                     describe_backend(loaded.dtype),
                     f"{compiled} of {loaded.n_layers} blocks compiled" if compiled
                     else "blocks as mlx-lm runs them")
            log.info("%s", describe_kv(self.kv, self.pool, layout))
        except Exception as exc:  # the server reports it on /health and exits
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("model load failed: %s", self.load_error)
            return False
        finally:
            self._ready.set()
        return True


    def _intake(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Command):
                _run_command(item)
            elif isinstance(item, Prepared):
                self.scheduler.intake(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> None:
        """schedule -> run -> postprocess: prefill within the token budget, then one decode."""
        clock = self.clock
        clock.start()
        self.scheduler.expire()
        for state in self.scheduler.admit():
            self._start(state)
        if not self.scheduler.running:
            clock.lap("schedule")
            return
        self._end(self.scheduler.cancelled(), FinishReason.CANCELLED)
        clock.lap("schedule")
        hook = self._row_hook if self.fault_hook is not None else None
        prefilled = self.runner.prefill(self.settings.batch.max_prefill_tokens_per_step, hook)
        clock.lap("prefill")
        self._postprocess(prefilled)
        clock.lap("postprocess")
        decoded = self.runner.decode(hook)  # laps decode_graph, sample_graph, submit, read
        self._postprocess(decoded)
        if decoded.rows:
            self.metrics.batch_step(decoded.rows)
            clock.steps += 1
        clock.lap("postprocess")

    def _row_hook(self, owner: int) -> None:
        self.fault_hook(self.scheduler.running[owner])

    def _start(self, state: RequestState) -> None:
        try:
            self.runner.add(state.owner, state.prompt_ids, state.request.params, state.prefix)
        except Exception as exc:
            log.exception("request %s failed to start", state.request_id)
            self._end([state], FinishReason.ERROR, Reason.MODEL_ERROR,
                      f"generation failed to start: {exc}")
            return
        self.metrics.admitted(time.monotonic() - state.submitted_at, len(state.prompt_ids))
        state.request.channel.put(Admitted(state.owner, len(state.prompt_ids),
                                           state.reservation.total))

    def _postprocess(self, out: RunOutput) -> None:
        """Tokens to events; requests that finished or failed end, together."""
        failed = {f.owner for f in out.failed}
        running = self.scheduler.running
        done = []
        for sampled in out.tokens:
            state = running.get(sampled.owner)
            if state is None or sampled.owner in failed:
                continue
            event = self.output.accept(state, sampled.token, sampled.logprobs)
            self.metrics.token(state)
            if event is not None and (event.text or event.logprob is not None):
                self._events.add(state.request.channel, event)
            if state.finish is not None:
                done.append(state)
        self._events.send()  # before any request's end: its tokens come first
        self._end(done)  # they leave the runner together (one filter of each layer)
        if out.failed:
            reset_random_state()  # a failure inside a compiled sampler poisons it
        for failure in out.failed:
            state, exc = running[failure.owner], failure.error
            log.error("model error in request %s: %s: %s", state.request_id,
                      type(exc).__name__, exc)
            self._end([state], FinishReason.ERROR, Reason.MODEL_ERROR,
                      f"{type(exc).__name__}: {exc}", held=failure.held)

    def _end(self, states: list[RequestState], reason: FinishReason | None = None,
             failure: Reason | None = None, message: str = "", held: int = 0) -> None:
        """End requests: rows out of the runner, owners retired, then the clients hear.

        Args:
            states: The requests.
            reason: How they ended (None: each one's own ``finish``).
            failure: Why, for ``FinishReason.ERROR``.
            message: What to tell the client of a failure.
            held: Blocks a request held when the runner already dropped it.
        """
        if not states:
            return
        peaks: dict[int, int] = {}
        try:
            if self.runner is not None:
                self._cache_outputs(states, reason)
                peaks = self.runner.remove(s.owner for s in states)
        finally:
            for state in states:
                kv_blocks = self.scheduler.release(
                    state, max(held, peaks.get(state.owner, 0)))
                self._notify_end(state, reason or state.finish, failure, message, kv_blocks)

    def _cache_outputs(self, states: list[RequestState], reason: FinishReason | None) -> None:
        """Requests that finished normally leave their output's full blocks in the cache.

        Only stop and length ends: a failed call may not have written its KV.
        Caching is an optimisation, so a fault here is logged, never raised.
        """
        if self.prefixes is None:
            return
        done = {s.owner for s in states
                if (reason or s.finish) in (FinishReason.STOP, FinishReason.LENGTH)}
        if not done:
            return
        try:
            self.runner.publish_outputs(done)
        except Exception:
            log.exception("caching the output blocks of %d requests failed", len(done))

    def _notify_end(self, state: RequestState, reason: FinishReason, failure: Reason | None,
                    message: str, kv_blocks: int) -> None:
        usage = Usage(len(state.prompt_ids), state.generated, kv_blocks, state.cached_tokens)
        if reason is FinishReason.ERROR:
            failure = failure or Reason.MODEL_ERROR
            state.request.channel.put(Failed(failure, message or "generation failed", usage))
        else:
            tail = ""
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                state.finish = reason
                tail = self.output.final_text(state)
            state.request.channel.put(Finished(reason, usage, tail))
        self.metrics.finished(state, reason, kv_blocks, failure)

    def _sample_memory(self, force: bool) -> None:
        # Every step (a few C calls): /metrics pairs MLX memory with the pool's KV
        # bytes of the same instant, so the two can be compared sample by sample.
        reserved = sum(s.reservation.total for s in self.scheduler.running.values())
        self.metrics.set_memory(memory_snapshot(), self.kv.snapshot(self.pool, reserved))

    def _shutdown(self) -> None:
        self._end(list(self.scheduler.running.values()), FinishReason.ERROR,
                  Reason.SHUTTING_DOWN, SHUTTING_DOWN)
        self.runner.close()
        # Before the inbox is drained: what the workers still deliver lands there.
        self._preparer.close()
        stopping = Rejected(Reason.SHUTTING_DOWN, SHUTTING_DOWN)
        self.scheduler.reject_waiting(stopping)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Command):
                item.future.set_exception(RuntimeError("the engine stopped"))
            elif item is not None:
                item.request.channel.put(stopping)


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


def _run_command(command: _Command) -> None:
    if not command.future.set_running_or_notify_cancel():
        return
    try:
        command.future.set_result(command.fn())
    except Exception as exc:
        command.future.set_exception(exc)
