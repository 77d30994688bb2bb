"""One engine step, and the one way every request ends (engine thread only).

:class:`EngineSteps` is the body of the engine's loop::

    step()   schedule: expire waiting requests, admit what fits (scheduler)
             run:      prefill new requests within the step's token budget,
                       then decode every running request in ONE model call (runner)
             postprocess: detokenize, stop strings, limits, events
                       (:class:`OutputProcessor`); finished requests leave the
                       runner and are released

Every exit path (done, stop, length, model error, cancellation, shutdown)
goes through :meth:`EngineSteps.end`, in the step that ended the request: its
rows leave the runner (blocks back to the pool), then the scheduler retires
its owner, then the client hears.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from server.channel import EventBatch
from server.engine.kv_memory import memory_snapshot
from server.engine.request_state import RequestState
from server.engine.run_output import CallHealth, RunOutput, StepClock
from server.engine.sampling import reset_random_state, token_logprob
from server.engine.tasks import PromptEmbedding, PromptScores
from server.metrics import ServerMetrics
from server.protocol import (
    Admitted,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    Usage,
)
from server.refusal import Reason
from server.text.grammar import ConstraintViolation
from server.text.token_bytes import TokenBytes, prime, primer_token
from veloxquant_mlx.freed_memory import release_freed_memory

log = logging.getLogger("veloxquant.server")

# Seconds with nothing to run after which the steps' freed buffers go back to the system:
# an idle server holds only what it uses, and back-to-back requests (each leaves the engine
# idle for a moment) keep the buffers the next one reuses. Given back at every idle moment
# instead, they cost SmolLM2 at c=1 about 1.4% of its tok/s.
IDLE_RELEASE_S = 1.0

# Called on the engine thread with a request's state right before each model
# call of that request; raising fails that request only (fault injection in tests).
FaultHook = Callable[[RequestState], None]


def prompt_task(request: GenerationRequest,
                prompt_ids: list[int]) -> PromptScores | PromptEmbedding | None:
    """The whole-prompt task a request asks for (scoring, an embedding), else None."""
    if request.score is not None:
        return PromptScores(prompt_ids, request.score)
    if request.embed is not None:
        return PromptEmbedding(prompt_ids, request.embed)
    return None


class OutputProcessor:
    """Turns each sampled token of a request into the event its client gets.

    The runner hands back bare token ids (and, when asked for, the distribution
    each was drawn from); here they become :class:`~server.protocol.TokenEvent`
    records, and a request is marked finished at an end token, a stop string or
    ``max_tokens``.

    Args:
        tokenizer: The model's tokenizer (each token's text and bytes for log-probabilities).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.token_bytes = TokenBytes(tokenizer)
        self.primer = primer_token(tokenizer)

    def accept(self, state: RequestState, token: int,
               logprobs: mx.array | None) -> TokenEvent | None:
        """Account for one generated token; set ``state.finish`` when the request is done.

        Args:
            state: The request.
            token: The sampled token id.
            logprobs: The ``(vocab,)`` log-probabilities it was drawn from, when
                the client asked for them.

        Returns:
            The event to send (None when nothing is to be sent for this token,
            e.g. the end token).
        """
        now = time.monotonic()
        if state.first_token_at is None:
            state.first_token_at = now
        state.prev_token_at = state.last_token_at
        state.last_token_at = now
        state.generated += 1
        if token in state.eos_ids:
            state.finish = FinishReason.STOP
            state.ended_on_eos = True
            held = state.stop.held_records()  # their text comes with the final flush
            return TokenEvent("", token, held) if held else None
        params = state.request.params
        logprob = None
        if params.logprobs and logprobs is not None:
            logprob = token_logprob(logprobs, token, params.top_logprobs, self.token_bytes)
        if not state.detokenizer.tokens:
            prime(state.detokenizer, self.primer)
        state.detokenizer.add_token(token)
        text, hit, records = state.stop.feed_token(state.detokenizer.last_segment, logprob)
        if hit:
            state.finish = FinishReason.STOP
        elif state.generated >= state.max_tokens:
            state.finish = FinishReason.LENGTH
            records += state.stop.held_records()  # their text comes with the final flush
        return TokenEvent(text, token, records)

    @staticmethod
    def final_text(state: RequestState) -> str:
        """Text still held back (detokenizer tail, partial stop match) at a normal end."""
        if state.tail_flushed or state.finish is None:
            return ""
        state.tail_flushed = True
        if state.finish is FinishReason.STOP and not state.ended_on_eos:
            return ""  # a stop string matched: everything after it is dropped
        state.detokenizer.finalize()
        text, hit = state.stop.feed(state.detokenizer.last_segment)
        return text if hit else text + state.stop.flush()


class EngineSteps:
    """Steps over the engine's parts; see the module docstring.

    Args:
        parts: The scheduler, runner, output processor, KV memory and prefixes
            (startup.EngineParts; untyped here, as startup sits above this module).
        max_prefill_tokens: Prompt tokens one step prefills at most.
        metrics: Request metrics.
        clock: Where step time goes (/metrics).
        fault_hook: Optional per-call hook, see :data:`FaultHook`.
        events_at_submit: Send a step's events at the next decode's submit (see
            :meth:`step`); False sends them as soon as they are ready.
        max_prefill_s: While requests decode, a step's prefill keeps to about this
            many seconds, its chunks cut to fit (0: the token bound alone; see
            :meth:`ModelRunner.prefill`).
    """

    def __init__(self, parts: Any, max_prefill_tokens: int, metrics: ServerMetrics,
                 clock: StepClock, fault_hook: FaultHook | None = None,
                 events_at_submit: bool = True, max_prefill_s: float = 0.0) -> None:
        self.scheduler, self.runner, self.output = parts.scheduler, parts.runner, parts.output
        self.kv, self.pool, self.prefixes = parts.kv, parts.pool, parts.prefixes
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_s = max_prefill_s
        self.metrics, self.clock, self.fault_hook = metrics, clock, fault_hook
        # Token and end events, sent together (a channel's in the order they came).
        self._events = EventBatch()
        self.health = CallHealth()  # model calls failing in a row: /health
        # When the step running now began (None between steps): a step that never
        # ends (a hung device, a peer rank gone inside a collective) shows on /health.
        self.busy_since: float | None = None
        # When requests last ran or waited; whether their freed memory went back since.
        self._busy_at, self._released = 0.0, True
        self.events_at_submit = events_at_submit
        self.runner.before_chunk = self._end_cancelled
        if events_at_submit:
            self.runner.before_submit = self._events.send

    def step(self) -> None:
        """schedule -> run -> postprocess: prefill within the token budget, then one decode.

        A step's events are not sent when they are ready but at the next decode's
        submit (``runner.before_submit``), a few milliseconds later: the engine
        thread then waits for the device without the GIL, and the event loop
        streams the tokens meanwhile. Sent at once, the loop's work for every
        stream competed with the engine building the next graph, both holding the
        GIL in turns, each step waiting for the loop's work. Where no decode
        follows soon (nothing left to decode, or a prefill's model calls come
        first) they are sent at once. That is ``batch.events_at_submit``, on a GPU
        by default (:func:`server.engine.startup.events_at_submit`); off, every
        batch of events is sent as soon as it is complete.
        """
        self.busy_since = time.monotonic()
        try:
            self._step()
        finally:
            self.busy_since = None

    def _step(self) -> None:
        clock = self.clock
        clock.start()
        runner = self.runner
        self.scheduler.expire()
        for state in self.scheduler.admit():
            self._start(state)
        if not self.scheduler.running:
            self._events.send()
            clock.lap("schedule")
            return
        self._end_cancelled()
        clock.lap("schedule")
        hook = self._row_hook if self.fault_hook is not None else None
        if runner.prompts_pending:
            self._events.send()  # before the prefill's model calls
        prefilled = runner.prefill(self.max_prefill_tokens, hook, self.max_prefill_s or None)
        clock.lap("prefill")
        self.health.record(prefilled)
        self._postprocess(prefilled)
        clock.lap("postprocess")
        decoded = runner.decode(hook)  # laps decode_graph, sample_graph, submit, read
        self.health.record(decoded)
        self._events.send()  # a call that failed before its submit sent nothing
        self._postprocess(decoded)
        if not (runner.rows or runner.joining):
            self._events.send()  # no decode next step to carry them
        if decoded.rows:
            self.metrics.batch_step(decoded.rows)
            clock.steps += 1
        clock.lap("postprocess")

    def _end_cancelled(self) -> None:
        """Requests whose client left end now (also between a step's prefill chunks)."""
        self.end(self.scheduler.cancelled(), FinishReason.CANCELLED)

    def _sent_unless_deferred(self) -> None:
        if not self.events_at_submit:
            self._events.send()

    def send_events(self) -> None:
        """Send the events not sent yet (the engine stops: no step follows)."""
        self._events.send()

    def _row_hook(self, owner: int) -> None:
        self.fault_hook(self.scheduler.running[owner])

    def _start(self, state: RequestState) -> None:
        try:
            self.runner.add(state.owner, state.prompt_ids, state.request.params, state.prefix,
                            prompt_task(state.request, state.prompt_ids))
        except Exception as exc:
            log.exception("request %s failed to start", state.request_id)
            self.end([state], FinishReason.ERROR, Reason.MODEL_ERROR,
                     f"generation failed to start: {exc}")
            return
        self.metrics.admitted(time.monotonic() - state.submitted_at, len(state.prompt_ids))
        state.request.channel.put(Admitted(state.owner, len(state.prompt_ids),
                                           state.reservation.total))

    def _postprocess(self, out: RunOutput) -> None:
        """Tokens to events; requests that finished or failed end, together."""
        failed = {f.owner for f in out.failed}
        running = self.scheduler.running
        done, generated = [], []
        for sampled in out.tokens:
            state = running.get(sampled.owner)
            if state is None or sampled.owner in failed:
                continue
            event = self.output.accept(state, sampled.token, sampled.logprobs)
            generated.append(state)
            if event is not None and (event.text or event.logprobs):
                self._events.add(state.request.channel, event)
            if state.finish is not None:
                done.append(state)
        self.metrics.tokens(generated)
        self.end(done)  # they leave the runner together (one filter of each layer)
        for done in out.tasks_done:  # scoring and embedding requests end with their task
            state = running.get(done.owner)
            if state is not None:
                state.result, state.finish = done.result, FinishReason.LENGTH
                self.end([state], held=done.held)
        self._sent_unless_deferred()
        if out.failed:
            reset_random_state()  # a failure inside a compiled sampler poisons it
        for failure in out.failed:
            state, exc = running[failure.owner], failure.error
            if isinstance(exc, ConstraintViolation):  # the request's schema, not the model
                self.end([state], FinishReason.ERROR, Reason.INVALID_VALUE, str(exc),
                         held=failure.held)
                continue
            log.error("model error in request %s: %s: %s", state.request_id,
                      type(exc).__name__, exc)
            self.end([state], FinishReason.ERROR, Reason.MODEL_ERROR,
                     f"{type(exc).__name__}: {exc}", held=failure.held)

    def end(self, states: list[RequestState], reason: FinishReason | None = None,
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
            self._cache_outputs(states, reason)
            peaks = self.runner.remove(s.owner for s in states)
        finally:
            for state in states:
                kv_blocks = self.scheduler.release(
                    state, max(held, peaks.get(state.owner, 0)))
                self._notify_end(state, reason or state.finish, failure, message, kv_blocks)
            self._sent_unless_deferred()

    def _cache_outputs(self, states: list[RequestState], reason: FinishReason | None) -> None:
        """Requests that finished normally leave their output's full blocks in the cache.

        Only stop and length ends: a failed call may not have written its KV.
        Caching is an optimisation, so a fault here is logged, never raised.
        """
        if not self.prefixes.enabled:
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
            # Queued behind the request's tokens, never ahead of them.
            self._events.add(state.request.channel,
                             Failed(failure, message or "generation failed", usage))
        else:
            tail = ""
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                state.finish = reason
                tail = self.output.final_text(state)
            self._events.add(state.request.channel, Finished(reason, usage, tail, state.result))
        self.metrics.finished(state, reason, kv_blocks, failure)

    def sample_memory(self) -> None:
        """Pair MLX's memory with the pool's KV bytes on /metrics; idle for
        :data:`IDLE_RELEASE_S`, first give the steps' freed buffers back to the system."""
        now = time.monotonic()
        if self.scheduler.running or self.scheduler.waiting:
            self._busy_at, self._released = now, False
        elif not self._released and now - self._busy_at >= IDLE_RELEASE_S:
            # MLX's buffer cache and glibc's heap keep what the last steps freed: on a 1B
            # model ~180 MiB after a few 8-row prompts, resident while nothing runs.
            release_freed_memory()
            self._released = True
        # Every step (a few C calls): /metrics pairs MLX memory with the pool's KV
        # bytes of the same instant, so the two can be compared sample by sample.
        reserved = sum(s.reservation.total for s in self.scheduler.running.values())
        self.metrics.set_memory(memory_snapshot(), self.kv.snapshot(self.pool, reserved))
