"""A refusal as the engine reports it: what was refused and its numbers, never words.

Whatever turns a request away before it runs (the prompt preparer, the
scheduler, the capacity planner, the engine as it stops) answers with a
:class:`Rejected`: a :class:`Why`, which names the :class:`Reason` (the error
code a client gets), the figures that explain it (token counts, limits, the
pool's arithmetic) and the request field at fault. Only the HTTP layer words
it for a person (:mod:`server.http.refusals`): every sentence a client reads
about a refusal is written in one place, and the engine's records stay data
that tests and metrics can compare.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Reason(str, enum.Enum):
    """Why the engine refused, dropped or failed a request (the value is the error code)."""

    EMPTY_PROMPT = "empty_prompt"  # the prompt tokenizes to nothing
    INVALID_PROMPT = "invalid_prompt"  # cannot be tokenized, or ids outside the vocabulary
    INVALID_VALUE = "invalid_value"  # a sampling value the model cannot take (logit_bias id)
    TOO_LARGE = "context_length_exceeded"  # over the prompt limit, or could never fit the pool
    QUEUE_FULL = "queue_full"  # no capacity now and the waiting queue is at its bound
    QUEUE_TIMEOUT = "queue_timeout"  # waited past limits.queue_timeout_s
    CANCELLED_WAITING = "cancelled_waiting"  # the client left while the request waited
    SHUTTING_DOWN = "shutting_down"  # the engine is stopping
    MODEL_ERROR = "generation_failed"  # the model raised while running this request


class Why(enum.Enum):
    """What exactly was refused, and the figures it carries; each has one :class:`Reason`."""

    EMPTY_PROMPT = ("empty_prompt", Reason.EMPTY_PROMPT)
    UNTOKENIZABLE = ("untokenizable", Reason.INVALID_PROMPT)  # error
    LONE_SURROGATE = ("lone_surrogate", Reason.INVALID_PROMPT)  # codepoint, index
    OUT_OF_VOCAB = ("out_of_vocab", Reason.INVALID_VALUE)  # token, vocab
    IGNORE_EOS_WITH_GRAMMAR = ("ignore_eos_with_grammar", Reason.INVALID_VALUE)
    PROMPT_BYTES_OVER_LIMIT = ("prompt_bytes_over_limit", Reason.TOO_LARGE)  # bytes, limit
    PROMPT_OVER_LIMIT = ("prompt_over_limit", Reason.TOO_LARGE)  # tokens, limit
    PROMPT_OVER_CONTEXT = ("prompt_over_context", Reason.TOO_LARGE)  # tokens, context
    CONVERSATION_MESSAGES = ("conversation_messages", Reason.TOO_LARGE)  # messages, limit
    CONVERSATION_CHARS = ("conversation_chars", Reason.TOO_LARGE)  # chars, limit, per_token
    NO_ROOM_IN_CONTEXT = ("no_room_in_context", Reason.TOO_LARGE)  # tokens, context
    NO_ROOM_IN_POOL = ("no_room_in_pool", Reason.TOO_LARGE)  # tokens, pool_tokens
    OVER_CONTEXT = ("over_context", Reason.TOO_LARGE)  # tokens, max_tokens, context, fits, pool
    NEVER_FITS_POOL = ("never_fits_pool", Reason.TOO_LARGE)  # a PoolMisfit, room
    GROUP_NEVER_FITS = ("group_never_fits", Reason.TOO_LARGE)  # a PoolMisfit, size
    PREPARER_BUSY = ("preparer_busy", Reason.QUEUE_FULL)  # pending
    QUEUE_FULL = ("queue_full", Reason.QUEUE_FULL)  # waiting, max_queue
    QUEUE_TIMEOUT = ("queue_timeout", Reason.QUEUE_TIMEOUT)  # timeout_s
    CANCELLED_WAITING = ("cancelled_waiting", Reason.CANCELLED_WAITING)
    SHUTTING_DOWN = ("shutting_down", Reason.SHUTTING_DOWN)
    MODEL_NOT_LOADED = ("model_not_loaded", Reason.SHUTTING_DOWN)
    ENGINE_STOPPED = ("engine_stopped", Reason.SHUTTING_DOWN)  # error
    PREPARE_FAILED = ("prepare_failed", Reason.MODEL_ERROR)  # error

    def __init__(self, code: str, reason: Reason) -> None:
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PoolMisfit:
    """Why a request's reservation could never fit the pool, even idle, in numbers.

    Attributes:
        n_tokens: Prompt plus the tokens to generate it reserves.
        blocks: KV blocks that needs on ``stream``.
        stream: The stream short of blocks (``"all"``: their total is).
        have: The most blocks the pool can ever give it there.
        most_tokens: The most tokens one request can reserve (0: none, the pool
            was shrunk below one).
        n_layers, block_size: The arithmetic behind ``blocks``.
        shared_stream: Keys and values draw from one stream (``x 2``).
    """

    n_tokens: int
    blocks: int
    stream: str
    have: int
    most_tokens: int
    n_layers: int
    block_size: int
    shared_stream: bool


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request was refused before running (size, queue full, wait timeout, stopping).

    Attributes:
        why: What was refused (its ``reason`` is the error code).
        figures: The numbers and names that explain it (see :class:`Why`).
        param: The request field at fault, if any.
    """

    why: Why
    figures: Mapping[str, Any] = field(default_factory=dict)
    param: str | None = None

    @property
    def reason(self) -> Reason:
        """The error code's reason (what metrics count and the HTTP status follows)."""
        return self.why.reason
