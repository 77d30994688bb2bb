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
from server.engine.protocol import FinishReason, GenerationRequest, TokenLogprob


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


class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries.

    Text is fed piece by piece; ``feed`` returns what is safe to emit now and
    whether a stop string was hit. Text that could still be the start of a
    stop string is held back until it either completes one (then it is dropped
    with everything after it) or cannot any more (then it is released)::

        stop = "END"   fed: "the E" -> emit "the ", hold "E"
                       fed: "N"     -> emit "",     hold "EN"
                       fed: "D!"    -> stop; output so far "the " (stop excluded)
    """

    __slots__ = ("_stops", "_hold", "_pending", "_records")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        # Longest proper prefix of a stop string that may be pending at the end of the text.
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        # Log-probability records of tokens whose text is still held, each with where its
        # text starts and ends relative to the held text (a start < 0: partly sent).
        self._records: list[tuple[TokenLogprob, int, int]] = []

    def feed_token(self, text: str, record: TokenLogprob | None
                   ) -> tuple[str, bool, tuple[TokenLogprob, ...]]:
        """:meth:`feed` one token's text, keeping its log-probability record in step.

        A record goes out with the event that releases the last of its token's
        text, and a token whose text lies wholly in a matched stop string (or
        after it) is never reported: joined, the records' tokens are the text.

        Returns:
            (text safe to emit, stop string hit, records to send with it).
        """
        if record is None and not self._records:
            return (*self.feed(text), ())
        start = len(self._pending)
        if record is not None:
            self._records.append((record, start, start + len(text)))
        out, hit = self.feed(text)
        sent = len(out)
        if hit:  # what started before the stop string was (partly) sent; the rest is dropped
            done = tuple(r for r, begin, _ in self._records if begin < sent)
            self._records = []
            return out, True, done
        done = tuple(r for r, _, end in self._records if end <= sent)
        self._records = [(r, begin - sent, end - sent) for r, begin, end in self._records
                         if end > sent]
        return out, False, done

    def held_records(self) -> tuple[TokenLogprob, ...]:
        """Records still held, released with the held text at the end (no stop string hit)."""
        done, self._records = tuple(r for r, _, _ in self._records), []
        return done

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, stop string hit)."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = ""
            return buf[:cut], True
        keep = self._partial_suffix(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of generation (no stop string completed)."""
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
