"""Turning a submitted request into prompt ids, on worker threads (no MLX work).

Failures become :class:`RequestRejected` carrying the event the client gets.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from server.metrics import ServerMetrics
from server.model_loader import LoadedModel
from server.protocol import ChatPrompt, GenerationRequest, SamplingParams
from server.refusal import Reason, Rejected, Why
from server.settings import LimitsSection
from server.text.bounds import conversation_bound, max_bytes_per_token
from server.text.chat_render import render_ids


class RequestRejected(Exception):
    """Raised inside intake to turn a request away before it queues."""

    def __init__(self, event: Rejected, prompt_tokens: int | None = None) -> None:
        super().__init__(event.why.code)
        self.event = event
        self.prompt_tokens = prompt_tokens  # the prompt's size, when it was tokenized


def prompt_field(prompt: str | list[int] | ChatPrompt) -> str:
    """The request field a refusal tells the client to shorten."""
    return "messages" if isinstance(prompt, ChatPrompt) else "prompt"


def no_room_in_pool(prompt: str | list[int] | ChatPrompt, n_prompt: int,
                    pool_tokens: int) -> Rejected:
    """The 400 for a prompt that alone fills what the KV pool holds for one request
    (``pool_tokens``): no ``max_tokens`` helps, so none is named."""
    return Rejected(Why.NO_ROOM_IN_POOL, {"tokens": n_prompt, "pool_tokens": pool_tokens},
                    prompt_field(prompt))


def vocab_size(loaded: LoadedModel) -> int | None:
    """The model's vocabulary size, when its config says it (None otherwise)."""
    return getattr(getattr(loaded.model, "args", None), "vocab_size", None)


def out_of_vocab(loaded: LoadedModel, ids: list[int]) -> int | None:
    """The first of ``ids`` outside the model's vocabulary, or None (also when its size is
    unknown)."""
    vocab = vocab_size(loaded)
    return None if vocab is None else next((t for t in ids if not 0 <= t < vocab), None)


def tokenize_prompt(loaded: LoadedModel, prompt: str | list[int] | ChatPrompt,
                    add_special: bool = True, parse_special: bool = True) -> list[int]:
    """Prompt ids for text, token ids or chat messages (rendered with the chat template).

    ``add_special`` and ``parse_special`` apply to text only (``/tokenize`` takes
    them; a generation always runs on the defaults): the tokenizer's own special
    tokens (a BOS) put in front, and special-token text such as ``<|im_start|>``
    read as that token rather than as its characters.

    Raises:
        RequestRejected: The prompt cannot be tokenized or has ids out of the vocabulary.
    """
    tokenizer = loaded.tokenizer
    try:
        if isinstance(prompt, ChatPrompt):
            return render_ids(tokenizer, prompt)
        if isinstance(prompt, str):
            utf8(prompt)  # a lone surrogate: said plainly, not in the tokenizer's words
            options = {} if parse_special else {"split_special_tokens": True}
            if not add_special:
                options["add_special_tokens"] = False
            return list(tokenizer.encode(prompt, **options))
        if out_of_vocab(loaded, prompt) is not None:
            raise ValueError(f"prompt token ids must be in 0..{vocab_size(loaded) - 1}")
        return list(prompt)
    except RequestRejected:
        raise
    except Exception as exc:
        raise RequestRejected(Rejected(Why.UNTOKENIZABLE, {"error": str(exc)},
                                       prompt_field(prompt))) from None


def ban_end_tokens(loaded: LoadedModel, params: SamplingParams) -> SamplingParams:
    """``params`` with the model's end tokens banned when the client asked ``ignore_eos``.

    Raises:
        RequestRejected: With a grammar (``response_format``, a forced tool call),
            whose only way to finish is an end token.
    """
    if not params.ignore_eos:
        return params
    if params.constraint is not None:
        raise RequestRejected(Rejected(Why.IGNORE_EOS_WITH_GRAMMAR, param="ignore_eos"))
    return replace(params, banned_tokens=tuple(sorted(loaded.tokenizer.eos_token_ids)))


def check_token_params(loaded: LoadedModel, params: SamplingParams) -> None:
    """Reject ``logit_bias`` token ids outside the model's vocabulary.

    They index the logits directly: an id past the end makes MLX read and
    write out of bounds (a crash of the whole process), and a negative one
    would silently bias a token counted from the end.

    Raises:
        RequestRejected: With the first offending id.
    """
    vocab = vocab_size(loaded)
    if vocab is None:
        return
    for token, _ in params.logit_bias:
        if not 0 <= token < vocab:
            raise RequestRejected(Rejected(Why.OUT_OF_VOCAB, {"token": token, "vocab": vocab},
                                           "logit_bias"))


def utf8(prompt: str) -> bytes:
    """The prompt's UTF-8 bytes.

    JSON can carry a lone UTF-16 surrogate (``"\\ud800"``), which Python keeps in the
    string but no UTF-8 encoder (nor the tokenizer) accepts.

    Raises:
        RequestRejected: The prompt holds such a surrogate (400 ``invalid_prompt``).
    """
    try:
        return prompt.encode()
    except UnicodeEncodeError as exc:
        raise RequestRejected(Rejected(
            Why.LONE_SURROGATE, {"codepoint": ord(prompt[exc.start]), "index": exc.start},
            "prompt")) from None



# Tokenizing prompts on a small pool of worker threads, never on the engine thread.
#
# Tokenizing a prompt near the body limit takes about a second; on the engine
# thread that second would freeze every running stream. So::
#
#     route -> Engine.submit -> PromptPreparer.submit   (event loop; never blocks)
#           -> worker thread: byte-count pre-check, tokenize, per-request checks
#           -> refused (Rejected on the request's channel)  or  (request, ids) -> engine inbox
#
# Hugging Face fast tokenizers release the GIL while they encode, so the
# engine thread keeps stepping meanwhile. The number of prompts accepted for
# preparation but not finished is bounded (``max_pending``); past it a request
# is refused with ``queue_full`` at once, which bounds the memory and CPU a
# burst of large prompts can claim.

log = logging.getLogger("veloxquant.server")

# Worker threads: enough to keep tokenizing while one huge prompt is in progress; small
# because each one competes with the engine thread for the CPU.
WORKERS = 2


class PromptPreparer:
    """Tokenizes and checks submitted requests on worker threads.

    Args:
        loaded: The loaded model (tokenizer, vocabulary).
        limits: ``max_prompt_tokens`` and the queue bound (``max_queue``).
        metrics: Where refusals are recorded.
        deliver: Called on a worker thread with each request whose prompt is
            tokenized and within the per-request limits, and its prompt ids (the
            engine makes its record of the request and puts it on its inbox).
        max_batch_size: Requests the engine runs at once (``batch.max_batch_size``).
    """

    def __init__(self, loaded: LoadedModel, limits: LimitsSection, metrics: ServerMetrics,
                 deliver: Callable[[GenerationRequest, list[int]], None],
                 max_batch_size: int = 0) -> None:
        self.loaded = loaded
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
                refusal = Rejected(Why.SHUTTING_DOWN)
            elif len(self._pending) >= self.max_pending:
                refusal = Rejected(Why.PREPARER_BUSY, {"pending": len(self._pending)})
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
            self.deliver(request, ids)
        except RequestRejected as exc:
            self.reject(request, exc.event, exc.prompt_tokens)
        except Exception as exc:  # a bug here must still answer the request, never hang it
            log.exception("preparing request %s failed", request.request_id)
            self.reject(request, Rejected(Why.PREPARE_FAILED, {"error": str(exc)}))
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
                raise RequestRejected(Rejected(
                    Why.PROMPT_BYTES_OVER_LIMIT,
                    {"bytes": n_bytes, "limit": self.max_prompt_tokens}, "prompt"))
        ids = tokenize_prompt(self.loaded, prompt)
        if not ids:
            raise RequestRejected(Rejected(Why.EMPTY_PROMPT, param="prompt"))
        if len(ids) > self.max_prompt_tokens:
            raise RequestRejected(Rejected(
                Why.PROMPT_OVER_LIMIT, {"tokens": len(ids), "limit": self.max_prompt_tokens},
                prompt_field(prompt)), len(ids))
        return ids

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
            self.reject(request, Rejected(Why.SHUTTING_DOWN))
