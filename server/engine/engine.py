"""The generation engine: the one thread that owns the model and all MLX work.

Routes call :meth:`Engine.submit` (thread-safe, non-blocking); the engine thread
answers through each request's :class:`~server.channel.EventChannel`. One loop::

    while running:
        intake   inbox (prompts tokenized by worker threads, server.text.prompts, each
                 as its RequestState) -> scheduler.intake (refused, or waiting)
        step     schedule, prefill, one decode, postprocess (server.engine.steps)
        memory   MLX's memory next to the pool's KV bytes (/metrics)

The parts the loop runs with are built on this thread once the model is
loaded (server.engine.startup). Every way a request ends goes through
:meth:`~server.engine.steps.EngineSteps.end`, shutdown included.
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

from server.engine.kv_memory import KVMemory, PromptPrefixes
from server.engine.request_state import RequestState
from server.engine.run_output import StepClock
from server.engine.runner import ModelRunner
from server.engine.scheduler import Scheduler
from server.engine.startup import (
    assemble,
    events_at_submit,
    make_pool,
    prefill_time_slice,
    release_thread_streams,
)
from server.engine.steps import EngineSteps, FaultHook, OutputProcessor
from server.engine.tasks import can_embed, echo_ids
from server.metrics import ServerMetrics
from server.model_loader import LoadedModel, load_model
from server.protocol import ConversationBound, FinishReason, GenerationRequest
from server.refusal import Reason, Rejected, Why
from server.settings import Settings
from server.text.chat_render import tool_call_format
from server.text.model_text import ModelText, grammar_cache
from server.text.prompts import PromptPreparer
from veloxquant_mlx.memory.prefix_cache import PrefixCache

log = logging.getLogger("veloxquant.server")

SHUTTING_DOWN = "the server is shutting down"


@dataclass(slots=True)
class _Command:
    """Work to run on the engine thread between steps (admin operations)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


class Engine(ModelText):
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
        self.pool = make_pool(settings)  # resized at load by pool.kv_memory
        self.metrics = metrics or ServerMetrics()
        self._loader = loader
        self.fault_hook = fault_hook
        self._inbox: queue.SimpleQueue[RequestState | _Command | None] = queue.SimpleQueue()
        self._preparer: PromptPreparer | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self.crash: str | None = None  # why the loop stopped on its own (it serves no more)
        self.crash_error: str | None = None  # the error that stopped it
        self.scheduler: Scheduler | None = None
        self.runner: ModelRunner | None = None
        self.output: OutputProcessor | None = None
        self.kv: KVMemory | None = None  # the arena and byte figures, once the model is loaded
        self.prefixes: PromptPrefixes | None = None  # prefix caching, once the model is loaded
        self.clock = StepClock()  # where step time goes (/metrics)
        self.steps: EngineSteps | None = None  # the loop's body, once the model is loaded
        self.grammars = grammar_cache(settings)  # compiled structured-output grammars

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

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may give the model, ``model_name`` first (none before load)."""
        return self.loaded.served_names if self.loaded else ()

    @property
    def context_length(self) -> int | None:
        """Positions one request may reach, prompt included (None: unbounded or not loaded)."""
        return self.loaded.context_length if self.loaded else None

    @property
    def conversation_bound(self) -> ConversationBound | None:
        """The sizes past which a conversation cannot fit, judged before its chat template
        runs (None before load)."""
        preparer = self._preparer
        return preparer.conversation_bound if preparer is not None else None

    @property
    def tool_call_format(self) -> str:
        """The syntax the model's chat template teaches for tool calls ("hermes" before load)."""
        loaded = self.loaded
        return tool_call_format(loaded.tokenizer) if loaded is not None else "hermes"

    def submit(self, request: GenerationRequest) -> None:
        """Hand a request to the prompt workers, then the engine thread (never blocks)."""
        preparer = self._preparer
        if preparer is None:
            request.channel.put(Rejected(Why.MODEL_NOT_LOADED))
            return
        preparer.submit(request)

    def drain(self) -> None:
        """The server is draining: refuse the requests that have not started (503
        ``shutting_down``, so a client can retry elsewhere at once) and any that
        still arrive; the running ones go on."""
        if self.scheduler is not None:
            self.run_on_engine(lambda: self.scheduler.close(self._stopping_refusal()))

    def run_on_engine(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two steps; returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Command(fn, future))
        return future

    def echo_ids(self, prompt: str | list[int]) -> list[int] | Rejected:
        """The ids of a prompt echoed but scored by no model (completions ``echo``
        without ``logprobs``), or its refusal. Tokenizes, so it blocks: call it from a
        worker thread. Scoring is a request (``GenerationRequest.score``)."""
        loaded = self.loaded
        if loaded is None:
            return Rejected(Why.MODEL_NOT_LOADED)
        return echo_ids(loaded, self.settings.limits.max_prompt_tokens, prompt)

    @property
    def can_embed(self) -> bool:
        """Whether the served model gives embeddings (its backbone's hidden states)."""
        return self.loaded is not None and can_embed(self.loaded.model)

    @property
    def embedding_size(self) -> int | None:
        """The width of the served model's embeddings (its hidden size), where known."""
        args = getattr(self.loaded.model, "args", None) if self.loaded else None
        return getattr(args, "hidden_size", None)

    def shrink(self, stream: str, target_free: int,
               force: bool = False) -> concurrent.futures.Future:
        """Retire free blocks, never below what running requests have reserved.

        Runs on the engine thread so no admission happens in between. A
        shrink that would take away the pool's room for one maximal request
        (``limits.max_prompt_tokens + limits.max_tokens_cap``, at most the
        context) is refused unless ``force``; while a shrink leaves a request
        less room than at start and a maximal one does not fit, :attr:`degraded`
        says why.

        Args:
            stream: "k", "v" or "kv" ("kv" on a split pool shrinks both).
            target_free: Free blocks to leave per stream.
            force: Shrink even below one maximal request.

        Returns:
            A future of ``(retired, kept_free)``: blocks retired and, per
            stream, the free blocks left. It raises
            :class:`~server.protocol.ShrinkRefused`.
        """
        return self.run_on_engine(lambda: self._shrink(stream, target_free, force))

    def _shrink(self, stream: str, target_free: int,
                force: bool) -> tuple[int, dict[str, int]]:
        retired, kept = self.scheduler.shrink(stream, target_free, force)
        if self.scheduler.degraded:
            log.warning("shrink: %s", self.scheduler.degraded)
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
        prefixes = self.prefixes
        return prefixes.cache if prefixes is not None and prefixes.enabled else None

    @property
    def failing(self) -> str | None:
        """Why the model's calls keep failing (several in a row, none run since), else None."""
        return self.steps.health.failing if self.steps is not None else None

    @property
    def stalled(self) -> str | None:
        """Why the engine looks hung (one step past ``limits.engine_stall_timeout_s``), else None.

        The engine thread cannot be interrupted inside a device call, so this is
        what a supervisor can see: ``/health`` answers 503 and new requests get
        503 at once rather than waiting on a thread that may never come back.
        """
        since = self.steps.busy_since if self.steps is not None else None
        limit = self.settings.limits.engine_stall_timeout_s
        if since is None or (busy := time.monotonic() - since) <= limit:
            return None
        return (f"the engine has been in one step for {busy:.0f} s (limits."
                f"engine_stall_timeout_s={limit:g}): the device or a peer rank stopped answering")

    @property
    def degraded(self) -> str | None:
        """Why the server cannot serve every valid request any more (a shrink), else None."""
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
                    self.steps.step()
                    self.steps.sample_memory()
                    self.clock.lap("memory")
            except Exception as exc:  # a bug, or a lost rank: fail everything cleanly
                log.exception("engine loop crashed")
                self.crash_error = f"{type(exc).__name__}: {exc}"
                self.crash = (f"the engine stopped after an error ({self.crash_error}); "
                              "restart the server")
                self._stopping.set()  # not ready from now on: /health says 503
            finally:
                self._shutdown()
        finally:
            release_thread_streams()
            # However the thread ended, nobody may wait for it to be ready any longer
            # (a start-up that waited forever would ignore SIGTERM too).
            self._ready.set()

    def _deliver(self, request: GenerationRequest, prompt_ids: list[int]) -> None:
        """A tokenized request (a worker thread's): its engine record, onto the inbox."""
        self._inbox.put(RequestState(request, prompt_ids))

    def _load(self) -> bool:
        parts = None
        try:
            parts = assemble(self.settings, self.pool, self._loader, self.metrics, self.clock,
                             self._deliver)
            steps = EngineSteps(parts, self.settings.batch.max_prefill_tokens_per_step,
                                self.metrics, self.clock, self.fault_hook,
                                events_at_submit(self.settings),
                                prefill_time_slice(self.settings))
        except Exception as exc:  # the server reports it on /health and exits
            if parts is not None:
                parts.preparer.close()  # its prompt workers would outlive the failure
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("model load failed: %s", self.load_error)
            self._ready.set()
            return False
        self.pool, self.kv, self.prefixes = parts.pool, parts.kv, parts.prefixes
        self.scheduler, self.runner, self.output = parts.scheduler, parts.runner, parts.output
        self._preparer, self.steps = parts.preparer, steps
        self.loaded = parts.loaded  # last: is_ready from here on
        self._ready.set()
        return True

    def _intake(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Command):
                self.steps.send_events()  # commands may run model work
                _run_command(item)
            elif isinstance(item, RequestState):
                self.scheduler.intake(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _shutdown(self) -> None:
        self.steps.end(list(self.scheduler.running.values()), FinishReason.ERROR,
                        Reason.SHUTTING_DOWN, self.crash or SHUTTING_DOWN)
        self.steps.send_events()
        self.runner.close()
        # Before the inbox is drained: what the workers still deliver lands there.
        self._preparer.close()
        self.scheduler.close(self._stopping_refusal())
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Command):
                item.future.set_exception(RuntimeError("the engine stopped"))
            elif item is not None:
                self.scheduler.intake(item)  # refused by the closed scheduler

    def _stopping_refusal(self) -> Rejected:
        """What a request that has not started gets once the engine stops taking work."""
        if self.crash_error is not None:
            return Rejected(Why.ENGINE_STOPPED, {"error": self.crash_error})
        return Rejected(Why.SHUTTING_DOWN)


def _run_command(command: _Command) -> None:
    if not command.future.set_running_or_notify_cancel():
        return
    try:
        command.future.set_result(command.fn())
    except Exception as exc:
        command.future.set_exception(exc)
