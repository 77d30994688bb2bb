"""Per-request records the engine keeps between steps.

A :class:`PendingRequest` waits in the scheduler's queue; once admitted it
becomes a :class:`RequestState`, which holds everything a request needs
across steps apart from how the model is driven (the runner keeps its cache
rows and sampler, keyed by the same owner id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.engine.capacity import Reservation
from server.engine.output import StopMatcher
from server.engine.protocol import FinishReason, GenerationRequest


@dataclass(slots=True)
class PendingRequest:
    """A tokenized request waiting in the admission queue."""

    request: GenerationRequest
    prompt_ids: list[int]
    reservation: Reservation
    enqueued_at: float
    deadline: float
    group: Any = None  # the ChoiceGroup it stands for (server.engine.choices), else None


@dataclass(slots=True)
class RequestState:
    """A running request.

    Invariant: while the record is in the scheduler's running map, ``owner``
    is registered on the pool; the scheduler retires the owner (its blocks
    back in the pool) before it drops the record, whatever ended it.

    Attributes:
        detokenizer: The tokenizer's streaming detokenizer of this request.
        stop: Its stop-string matcher.
        eos_ids: Tokens that end generation.
        generated: Tokens sampled so far.
        finish: Set by the output processor when the request is done.
        tail_flushed: The held-back text was sent (it is sent once).
        ended_on_eos: The last token was an end token, not a stop string.
        prefix: What its prompt reuses and will publish (prefix caching).
        cached_tokens: Prompt tokens it did not compute (``usage.prompt_tokens_details``).
    """

    request: GenerationRequest
    owner: int
    prompt_ids: list[int]
    reservation: Reservation
    submitted_at: float
    detokenizer: Any
    stop: StopMatcher
    eos_ids: frozenset[int]
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    prev_token_at: float = 0.0
    finish: FinishReason | None = None
    tail_flushed: bool = False
    ended_on_eos: bool = False
    prefix: Any = None  # its PrefixHit (server.engine.prefix) when prefix caching is on
    cached_tokens: int = 0  # prompt tokens served from cached blocks
    result: Any = None  # a whole-prompt task once done (server.engine.steps.prompt_task)

    @property
    def request_id(self) -> str:
        """The client-facing id."""
        return self.request.request_id

    @property
    def max_tokens(self) -> int:
        """The request's generation limit."""
        return self.request.params.max_tokens
