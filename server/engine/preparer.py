"""Tokenizing prompts on a small pool of worker threads, never on the engine thread.

Tokenizing a prompt near the body limit takes about a second; on the engine
thread that second would freeze every running stream. So::

    route -> Engine.submit -> PromptPreparer.submit   (event loop; never blocks)
          -> worker thread: byte-count pre-check, tokenize, per-request checks
          -> refused (Rejected on the request's channel)  or  Prepared -> engine inbox

Hugging Face fast tokenizers release the GIL while they encode, so the
engine thread keeps stepping meanwhile. The number of prompts accepted for
preparation but not finished is bounded (``max_pending``); past it a request
is refused with ``queue_full`` at once, which bounds the memory and CPU a
burst of large prompts can claim.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from server.engine.chat_bound import conversation_bound
from server.engine.intake import (
    RequestRejected,
    ban_end_tokens,
    check_token_params,
    no_room,
    no_room_in_pool,
    tokenize_prompt,
    utf8,
)
from server.engine.prompt_bound import max_bytes_per_token
from server.engine.protocol import ChatPrompt, GenerationRequest, Reason, Rejected
from server.metrics import ServerMetrics
from server.model_loader import LoadedModel
from server.settings import LimitsSection

log = logging.getLogger("veloxquant.server")

# Worker threads: enough to keep tokenizing while one huge prompt is in progress; small
# because each one competes with the engine thread for the CPU.
WORKERS = 2


@dataclass(slots=True)
class Prepared:
    """A request whose prompt is tokenized and within the per-request limits."""

    request: GenerationRequest
    prompt_ids: list[int]


class PromptPreparer:
    """Tokenizes and checks submitted requests on worker threads.

    Args:
        loaded: The loaded model (tokenizer, vocabulary).
        limits: ``max_prompt_tokens`` and the queue bound (``max_queue``).
        metrics: Where refusals are recorded.
        deliver: Called on a worker thread with each :class:`Prepared` request
            (the engine puts it on its inbox).
        max_batch_size: Requests the engine runs at once (``batch.max_batch_size``).
    """

    def __init__(self, loaded: LoadedModel, limits: LimitsSection, metrics: ServerMetrics,
                 deliver: Callable[[Prepared], None], max_batch_size: int = 0,
                 pool_tokens: Callable[[], int | None] = lambda: None) -> None:
        self.loaded = loaded
        # The most tokens the KV pool can hold for one request (None: no bound), so that a
        # refusal over the context gives advice the pool's own check will not overrule.
        self.pool_tokens = pool_tokens
        self.max_prompt_tokens = limits.max_prompt_tokens
        # Requests being prepared at once, beyond which new ones are refused: what an idle
        # server takes from one burst (a batch that starts, then the waiting queue's bound),
        # and at least the workers' head room.
        self.max_pending = limits.max_queue + max(max_batch_size, 2 * WORKERS)
        self.metrics = metrics
        self.deliver = deliver
        per_token = max_bytes_per_token(loaded.tokenizer)
        self.max_prompt_bytes = None if per_token is None else self.max_prompt_tokens * per_token
        # What the HTTP side judges a conversation by before its template runs.
        self.conversation_bound = conversation_bound(loaded.tokenizer, self.max_prompt_tokens,
                                                     per_token)
        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, "veloxquant-tokenize")
        self._lock = threading.Lock()
        # Requests accepted and not yet delivered or refused, by id().
        self._pending: dict[int, GenerationRequest] = {}
        self._closed = False

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request`` for preparation, or refuse it at once (any thread; never blocks)."""
        with self._lock:
            if self._closed:
                refusal = Rejected(Reason.SHUTTING_DOWN, "the server is shutting down")
            elif len(self._pending) >= self.max_pending:
                refusal = Rejected(Reason.QUEUE_FULL, f"server busy: {len(self._pending)} "
                                   "prompts are being tokenized; retry later")
            else:
                refusal = None
                self._pending[id(request)] = request
                self._pool.submit(self._prepare, request)
        if refusal is not None:
            self.reject(request, refusal)

    def reject(self, request: GenerationRequest, event: Rejected,
               prompt_tokens: int | None = None) -> None:
        """Refuse a request that never ran (thread-safe)."""
        self.metrics.rejected(event.reason, request, prompt_tokens)
        request.channel.put(event)

    def _prepare(self, request: GenerationRequest) -> None:
        try:
            if request.cancelled.is_set():
                self.metrics.rejected(Reason.CANCELLED_WAITING, request)
                return
            ids = self.prompt_ids(request)
            check_token_params(self.loaded, request.params)
            request.params = ban_end_tokens(self.loaded, request.params)
            self.fit_context(request, len(ids))
            self.deliver(Prepared(request, ids))
        except RequestRejected as exc:
            self.reject(request, exc.event, exc.prompt_tokens)
        except Exception as exc:  # a bug here must still answer the request, never hang it
            log.exception("preparing request %s failed", request.request_id)
            self.reject(request, Rejected(Reason.MODEL_ERROR,
                                          f"preparing the prompt failed: {exc}"))
        finally:
            with self._lock:
                self._pending.pop(id(request), None)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The request's prompt ids, checked against ``limits.max_prompt_tokens``.

        Raises:
            RequestRejected: Too long (from its bytes alone when that proves it,
                else after tokenizing), empty, or not tokenizable.
        """
        prompt = request.prompt
        if isinstance(prompt, str) and self.max_prompt_bytes is not None:
            n_bytes = len(utf8(prompt))
            if n_bytes > self.max_prompt_bytes:
                raise self._too_long(f"prompt has {n_bytes} bytes, so more than "
                                     f"limits.max_prompt_tokens={self.max_prompt_tokens} "
                                     "tokens; shorten the prompt")
        ids = tokenize_prompt(self.loaded, prompt)
        if not ids:
            raise RequestRejected(Rejected(Reason.EMPTY_PROMPT, "the prompt is empty (0 tokens)",
                                           "prompt"))
        if len(ids) > self.max_prompt_tokens:
            chat = isinstance(prompt, ChatPrompt)
            raise self._too_long(f"{'the rendered messages have' if chat else 'prompt has'} "
                                 f"{len(ids)} tokens, more than "
                                 f"limits.max_prompt_tokens={self.max_prompt_tokens}; "
                                 f"shorten the {'messages' if chat else 'prompt'}",
                                 "messages" if chat else "prompt", len(ids))
        return ids

    def fit_context(self, request: GenerationRequest, n_prompt: int) -> None:
        """Keep prompt + ``max_tokens`` within the model's context length.

        An omitted ``max_tokens`` is lowered to the room the context leaves
        (``request.params`` replaced); one the client sent that goes past it is refused,
        as OpenAI refuses it, instead of generating past the positions the model knows.

        Raises:
            RequestRejected: Over the context (400 ``context_length_exceeded``).
        """
        context = self.loaded.context_length
        params = request.params
        if context is None or n_prompt + params.max_tokens <= context:
            return
        room = context - n_prompt
        if params.max_tokens_defaulted and room >= 1:
            request.params = replace(params, max_tokens=room)
            return
        if room < 1 or params.max_tokens_defaulted:
            raise RequestRejected(no_room(request.prompt, n_prompt,
                                          self.loaded.context_phrase()), n_prompt)
        pool = self.pool_tokens()
        if pool is not None and n_prompt >= pool:  # the pool would refuse the prompt next
            raise RequestRejected(no_room_in_pool(request.prompt, n_prompt, pool), n_prompt)
        field = params.max_tokens_param
        fits = room if pool is None else min(room, pool - n_prompt)
        why = "" if fits == room else f" (the KV pool holds at most {pool} tokens a request)"
        raise self._too_long(
            f"the prompt's {n_prompt} tokens plus {field}={params.max_tokens} come to "
            f"{n_prompt + params.max_tokens} tokens, over {self.loaded.context_phrase()}; "
            f"lower {field} to at most {fits}{why}, or shorten "
            f"the {'messages' if isinstance(request.prompt, ChatPrompt) else 'prompt'}",
            field, n_prompt)

    @staticmethod
    def _too_long(message: str, param: str = "prompt",
                  prompt_tokens: int | None = None) -> RequestRejected:
        return RequestRejected(Rejected(Reason.TOO_LARGE, message, param), prompt_tokens)

    def close(self) -> None:
        """Stop taking requests; finish the ones in progress, refuse the queued ones.

        Call on the engine thread while it stops: what the workers deliver
        meanwhile lands on the inbox, which the engine drains afterwards.
        """
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        # Anything still pending had its future cancelled before it ran.
        with self._lock:
            left = list(self._pending.values())
            self._pending.clear()
        for request in left:
            self.reject(request, Rejected(Reason.SHUTTING_DOWN, "the server is shutting down"))
