"""The generation engine: the one thread that owns the model and all MLX work.

Routes call :meth:`Engine.submit` (thread-safe, non-blocking); the engine
thread answers through each request's :class:`~server.generation.EventChannel`.
One loop, one thread::

    while running:
        intake()    inbox -> tokenize -> reject (size/queue) or enqueue
        expire()    waiting past queue_timeout_s -> 429
        admit()     waiting -> running while the pool can hold the reservation
                    and the batch has room (batch.max_batch_size)
        step()      prefill new requests (chunked, batch.max_prefill_tokens_per_step;
                    each sends its first token at once), then decode every joined
                    request in ONE batched model call (server/batch.py), then
                    postprocess (detokenize, stop strings, limits, events)

A request's blocks are released in ``_finish``, which every exit path goes
through (done, stop, length, model error, cancellation, shutdown), in the same
step that ended it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.batch import DecodeBatch
from server.decode import memory_snapshot
from server.generation import (
    Admitted,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Rejected,
    Usage,
)
from server.intake import RequestRejected, check_token_params, tokenize_prompt
from server.metrics import ServerMetrics
from server.model_loader import LoadedModel, load_model
from server.request_state import PendingRequest, RequestState
from server.sampling import StopMatcher, reset_random_state
from server.scheduler import CapacityPlanner, Reservation
from server.settings import Settings
from veloxquant_mlx.cpu_backend import describe_backend
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig

log = logging.getLogger("veloxquant.server")

# Test hook (issue 7 fault injection): called on the engine thread with the
# request's state right before each model step of that request; raising fails
# that request only.
FaultHook = Callable[[RequestState], None]


@dataclass(slots=True)
class _Command:
    """Work to run on the engine thread between steps (admin operations)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


def make_pool(settings: Settings) -> BlockPoolAllocator:
    """Build the shared pool from the ``[pool]`` settings."""
    p = settings.pool
    return BlockPoolAllocator(
        PoolConfig(
            block_size=p.block_size,
            n_blocks=p.n_blocks,
            separate_kv=p.separate_kv,
            grow_on_exhaustion=p.grow_on_exhaustion,
            max_blocks=p.max_blocks or None,
        )
    )


class Engine:
    """Owns the model thread, the admission queue and the shared pool.

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
        self._inbox: queue.SimpleQueue[GenerationRequest | _Command | None] = queue.SimpleQueue()
        self._waiting: deque[PendingRequest] = deque()
        self._running: list[RequestState] = []
        self._owners = itertools.count(1)
        self._live_lock = threading.Lock()
        self._live: dict[int, str] = {}  # owner -> request id, for metrics and admin
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self._planner: CapacityPlanner | None = None
        self._batch: DecodeBatch | None = None
        self._exit_blocks: dict[int, int] = {}  # owner -> blocks held when it left the batch
        self._memory_at = 0.0

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
        """Queue a request for the engine thread (never blocks)."""
        self._inbox.put(request)

    def run_on_engine(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two steps; returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Command(fn, future))
        return future

    def shrink(self, stream: str, target_free: int) -> concurrent.futures.Future:
        """Retire free blocks, never below what running requests have reserved.

        Runs on the engine thread so no admission happens in between.

        Args:
            stream: "k", "v" or "kv" ("kv" on a split pool shrinks both).
            target_free: Free blocks to leave per stream.

        Returns:
            A future of ``(retired, floors)``: blocks retired and, per stream,
            the free blocks kept for running requests' reservations.
        """
        return self.run_on_engine(lambda: self._shrink(stream, target_free))

    def _shrink(self, stream: str, target_free: int) -> tuple[int, dict[str, int]]:
        streams = self.pool.config.streams
        targets = streams if stream == "kv" or len(streams) == 1 else (stream,)
        outstanding = self._planner.outstanding((s.owner, s.reservation) for s in self._running)
        retired = 0
        floors = {}
        for name in targets:
            floors[name] = max(target_free, outstanding.get(name, 0))
            retired += self.pool.shrink(name, floors[name])
        return retired, floors

    def live_requests(self) -> dict[int, str]:
        """Owner id -> request id of every request holding (or about to hold) blocks."""
        with self._live_lock:
            return dict(self._live)

    def queue_depths(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return len(self._running), len(self._waiting)

    # -- the loop (engine thread) ---------------------------------------------

    def _run(self) -> None:
        try:
            self.loaded = self._loader(self.settings.model)
            self._planner = CapacityPlanner(self.pool, self.loaded.n_layers)
            self._batch = DecodeBatch(self.loaded.model, self.loaded.tokenizer, self.pool,
                                      self.settings.batch.prefill_chunk_size)
            # The one start-up line that says what the server computes with.
            log.info("model %s loaded (%d layers); backend: %s", self.loaded.name,
                     self.loaded.n_layers, describe_backend(self.loaded.dtype))
        except Exception as exc:  # the server reports it on /health and exits
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("model load failed: %s", self.load_error)
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping.is_set():
                idle = not self._running
                self._intake(timeout=0.05 if idle else 0.0)
                self._expire()
                self._admit()
                if self._running:
                    self._step()
                self._sample_memory(force=idle)
        except Exception:  # a bug in the loop itself: fail everything cleanly
            log.exception("engine loop crashed")
        finally:
            self._shutdown()

    def _intake(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Command):
                _run_command(item)
            elif item is not None:
                self._enqueue(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _enqueue(self, request: GenerationRequest) -> None:
        limits = self.settings.limits
        try:
            prompt_ids = tokenize_prompt(self.loaded, request.prompt)
            check_token_params(self.loaded, request.params)
            need = self._check_size(request, prompt_ids)
            if len(self._waiting) >= limits.max_queue and not (
                    self._has_room() and self._fits_now(need)):
                raise RequestRejected(Rejected(
                    429, f"server busy: {len(self._waiting)} requests already wait for KV "
                    f"capacity (limits.max_queue={limits.max_queue}); retry later",
                    "queue_full", retry_after=limits.retry_after_s))
        except RequestRejected as exc:
            self.metrics.rejected(exc.event.code, request, exc.event.status)
            request.channel.put(exc.event)
            return
        now = time.monotonic()
        self._waiting.append(PendingRequest(request, prompt_ids, need, now,
                                            now + limits.queue_timeout_s))

    def _check_size(self, request: GenerationRequest, prompt_ids: list[int]) -> Reservation:
        limits = self.settings.limits
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise RequestRejected(Rejected(400, "the prompt is empty (0 tokens)",
                                           "empty_prompt", "prompt"))
        if n_prompt > limits.max_prompt_tokens:
            raise RequestRejected(Rejected(
                400, f"prompt has {n_prompt} tokens, more than limits.max_prompt_tokens="
                f"{limits.max_prompt_tokens}; shorten the prompt", "context_length_exceeded",
                "prompt"))
        n_tokens = n_prompt + request.params.max_tokens
        need = self._planner.reservation(n_tokens)
        if not self._fits_now(need):
            why = self._planner.never_fits(need, n_tokens)
            if why is not None:
                raise RequestRejected(Rejected(400, why, "context_length_exceeded",
                                               "max_tokens"))
        return need

    def _has_room(self) -> bool:
        return len(self._running) < self.settings.batch.max_batch_size

    def _fits_now(self, need: Reservation) -> bool:
        running = ((s.owner, s.reservation) for s in self._running)
        return self._planner.fits_now(need, self._planner.outstanding(running))

    def _expire(self) -> None:
        if not self._waiting:
            return
        now = time.monotonic()
        keep: deque[PendingRequest] = deque()
        for pending in self._waiting:
            if pending.request.cancelled.is_set():
                self.metrics.rejected("cancelled_waiting", pending.request, 499)
                continue
            if now >= pending.deadline:
                limits = self.settings.limits
                self.metrics.rejected("queue_timeout", pending.request, 429)
                pending.request.channel.put(Rejected(
                    429, f"no KV capacity within limits.queue_timeout_s="
                    f"{limits.queue_timeout_s}s; retry later", "queue_timeout",
                    retry_after=limits.retry_after_s))
                continue
            keep.append(pending)
        self._waiting = keep

    def _admit(self) -> None:
        """Move waiting requests to running, first come first served, while they fit."""
        if not self._waiting:
            return
        outstanding = self._planner.outstanding((s.owner, s.reservation) for s in self._running)
        while self._waiting and self._has_room():
            head = self._waiting[0]
            if not self._planner.fits_now(head.reservation, outstanding):
                break
            self._waiting.popleft()
            for stream, blocks in head.reservation.per_stream.items():
                outstanding[stream] = outstanding.get(stream, 0) + blocks
            self._start(head)

    def _start(self, pending: PendingRequest) -> None:
        request = pending.request
        owner = next(self._owners)
        tokenizer = self.loaded.tokenizer
        state = RequestState(
            request=request, owner=owner, prompt_ids=pending.prompt_ids,
            reservation=pending.reservation, submitted_at=pending.enqueued_at,
            detokenizer=tokenizer.detokenizer, stop=StopMatcher(request.params.stop),
            eos_ids=frozenset(tokenizer.eos_token_ids),
        )
        with self._live_lock:
            self._live[owner] = request.request_id
        self._running.append(state)
        try:
            self.pool.register_owner(owner)
            self._batch.add(state)
        except Exception as exc:
            log.exception("request %s failed to start", request.request_id)
            self._finish(state, FinishReason.ERROR, f"generation failed to start: {exc}")
            return
        self.metrics.admitted(time.monotonic() - pending.enqueued_at, len(pending.prompt_ids))
        request.channel.put(Admitted(owner, len(state.prompt_ids), pending.reservation.total))

    def _step(self) -> None:
        """Cancellations, then prefill within the token budget, then one batched decode."""
        for state in [s for s in self._running if s.request.cancelled.is_set()]:
            self._finish(state, FinishReason.CANCELLED)
        out = self._batch.run_step(self.settings.batch.max_prefill_tokens_per_step,
                                   self.fault_hook)
        self._exit_blocks.update(out.held)
        failed = {state.owner for state, _ in out.failed}
        done = []
        for item in out.emitted:
            state, event = item.state, item.event
            if state.owner in failed:
                continue
            self.metrics.token(state)
            if event is not None and (event.text or event.logprob is not None):
                state.request.channel.put(event)
            if state.finish is not None:
                done.append(state)
        if done:  # they leave the batch together (one filter), then end
            self._exit_blocks.update(self._batch.remove(done))
            for state in done:
                self._finish(state, state.finish)
        if out.failed:
            reset_random_state()  # a failure inside a compiled sampler poisons it
        for state, exc in out.failed:
            log.error("model error in request %s: %s: %s", state.request_id,
                      type(exc).__name__, exc)
            self._finish(state, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        if out.decoded_rows:
            self.metrics.batch_step(out.decoded_rows)

    def _finish(
        self, state: RequestState, reason: FinishReason, error: str = "", status: int = 500
    ) -> None:
        """End a request: release its blocks first, then tell the client."""
        kv_blocks = 0
        tail = ""
        try:
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                state.finish = reason
                tail = state.final_text()
        finally:
            kv_blocks = self._release(state)
        usage = Usage(len(state.prompt_ids), state.generated, kv_blocks)
        if reason is FinishReason.ERROR:
            state.request.channel.put(Failed(error or "generation failed", usage, status))
        else:
            state.request.channel.put(Finished(reason, usage, tail))
        self.metrics.finished(state, reason, kv_blocks, status)

    def _release(self, state: RequestState) -> int:
        """Free every block of the request's owner; return the peak it held."""
        if state in self._running:
            self._running.remove(state)
        held = self._exit_blocks.pop(state.owner, 0)
        try:
            held = max(held, self.pool.n_blocks_held(state.owner))
            if self._batch is not None:
                self._batch.remove([state])  # its rows of every layer leave the batch
        finally:
            try:
                self.pool.free_all(state.owner)  # whatever the batch did not give back
                self.pool.release_owner(state.owner)
            finally:
                with self._live_lock:
                    self._live.pop(state.owner, None)
        return held

    def _sample_memory(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._memory_at > 0.5:
            self._memory_at = now
            self.metrics.set_memory(memory_snapshot())

    def _shutdown(self) -> None:
        for state in list(self._running):
            self._finish(state, FinishReason.ERROR, "the server is shutting down", status=503)
        if self._batch is not None:
            self._batch.close()
        stopping = Rejected(503, "the server is shutting down", "shutting_down")
        while self._waiting:
            self._waiting.popleft().request.channel.put(stopping)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Command):
                item.future.set_exception(RuntimeError("the engine stopped"))
            elif item is not None:
                item.channel.put(stopping)


def _run_command(command: _Command) -> None:
    if not command.future.set_running_or_notify_cancel():
        return
    try:
        command.future.set_result(command.fn())
    except Exception as exc:
        command.future.set_exception(exc)
