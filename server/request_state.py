"""Per-request state kept by the engine between steps.

The record holds everything a request needs across steps apart from how the
model is driven: prompt ids, owner, reservation, output bookkeeping, stop
matching and timings. Its caches and sampler live in the batch
(:mod:`server.batch`, :mod:`server.prefill`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from server.generation import (
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
)
from server.sampling import StopMatcher
from server.scheduler import Reservation


@dataclass(slots=True)
class PendingRequest:
    """A tokenized request waiting in the admission queue."""

    request: GenerationRequest
    prompt_ids: list[int]
    reservation: Reservation
    enqueued_at: float
    deadline: float


@dataclass(slots=True)
class RequestState:
    """A running request.

    Invariant: while the record is in the engine's running list, ``owner`` is
    registered on the pool and listed as live; the engine releases the
    owner's blocks before dropping the record, whatever ended it.
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
    # The text a stop string may still need, flushed when the request ends.
    tail_flushed: bool = False
    ended_on_eos: bool = False

    @property
    def request_id(self) -> str:
        """The client-facing id."""
        return self.request.request_id

    @property
    def max_tokens(self) -> int:
        """The request's generation limit."""
        return self.request.params.max_tokens

    def accept_token(self, token: int, logprob: TokenLogprob | None) -> TokenEvent | None:
        """Account for one generated token; set ``finish`` when the request is done.

        Args:
            token: The sampled token id.
            logprob: Its log-probability record, when the client asked for them.

        Returns:
            The event to send (None when nothing is to be sent for this token,
            e.g. the EOS token or text swallowed by a stop string).
        """
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.prev_token_at = self.last_token_at
        self.last_token_at = now
        self.generated += 1
        if token in self.eos_ids:
            self.finish = FinishReason.STOP
            self.ended_on_eos = True
            return None
        self.detokenizer.add_token(token)
        text, hit = self.stop.feed(self.detokenizer.last_segment)
        if hit:
            self.finish = FinishReason.STOP
        elif self.generated >= self.max_tokens:
            self.finish = FinishReason.LENGTH
        return TokenEvent(text, token, logprob)

    def final_text(self) -> str:
        """Text still held back (detokenizer tail, partial stop match) at a normal end."""
        if self.tail_flushed or self.finish is None:
            return ""
        self.tail_flushed = True
        if self.finish is FinishReason.STOP and not self.ended_on_eos:
            return ""  # a stop string matched: everything after it is dropped
        self.detokenizer.finalize()
        text, hit = self.stop.feed(self.detokenizer.last_segment)
        return text if hit else text + self.stop.flush()
