"""The engine's one record of a request, and the choice groups whose ``n`` requests
are admitted together (:class:`ChoiceHolds`, further down).

A :class:`RequestState` is made when the prompt is tokenized and lives to the
request's end: it waits in the scheduler's queue, runs, and ends, its
:class:`Status` saying which. It holds everything a request needs across steps
apart from how the model is driven (the runner keeps its cache rows and
sampler, keyed by the same owner id).
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from server.engine.capacity import Reservation
from server.protocol import ChoiceGroup, FinishReason, GenerationRequest, TokenLogprob
from server.refusal import Rejected


class Status(enum.Enum):
    """Where a request is in its life; the scheduler moves it on."""

    WAITING = "waiting"  # tokenized, in the admission queue (or held with its choice group)
    RUNNING = "running"  # admitted: its owner registered on the pool, its rows in the runner
    DONE = "done"  # ended or refused; an owner it had is retired, its blocks back


@dataclass(slots=True)
class RequestState:
    """One request inside the engine, from the moment its prompt is tokenized to its end.

    The same record waits in the scheduler's queue, runs (in its running map,
    keyed by ``owner``), and ends; the runner keeps its rows (sampler, cache
    views) under the same owner id.

    Invariant: while the record is in the scheduler's running map, ``owner``
    is registered on the pool; the scheduler retires the owner (its blocks
    back in the pool) before it drops the record, whatever ended it.

    Attributes:
        reservation: Blocks it may need, per stream (set at intake, smaller once an
            omitted ``max_tokens`` was lowered to fit).
        submitted_at: When it reached the scheduler; ``deadline``: when waiting ends.
        group: The ChoiceGroup it stands for while waiting (its first choice), else None.
        owner: Its pool owner id, from admission on (0 before).
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
    prompt_ids: list[int]
    reservation: Reservation = field(default_factory=lambda: Reservation({}))
    submitted_at: float = 0.0
    deadline: float = math.inf
    group: Any = None
    status: Status = Status.WAITING
    owner: int = 0
    detokenizer: Any = None
    stop: StopMatcher | None = None
    eos_ids: frozenset[int] = frozenset()
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    prev_token_at: float = 0.0
    finish: FinishReason | None = None
    tail_flushed: bool = False
    ended_on_eos: bool = False
    prefix: Any = None  # its PrefixHit (server.engine.kv_memory) when prefix caching is on
    cached_tokens: int = 0  # prompt tokens served from cached blocks
    result: Any = None  # a whole-prompt task once done (server.engine.steps.prompt_task)

    def queued(self, reservation: Reservation, now: float, timeout_s: float,
               group: Any = None) -> RequestState:
        """Enters the admission queue at ``now`` with ``reservation``; returns itself."""
        self.reservation, self.submitted_at, self.group = reservation, now, group
        self.deadline = now + timeout_s
        return self

    def start(self, owner: int, tokenizer: Any) -> None:
        """Admitted as ``owner``: it gets what generating needs (detokenizer, stops)."""
        self.owner, self.status = owner, Status.RUNNING
        self.detokenizer = tokenizer.detokenizer
        self.stop = StopMatcher(self.request.params.stop)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)

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



# The ``n`` choices of one prompt: admitted together or refused at once, never half-started.
#
# Each choice is its own engine request (owner, blocks, sampler), but admitting
# them one by one let 15 of 16 start and the 16th wait at the head of the
# queue, holding back every other client with most of the pool reserved, until
# its 429 threw the 15 away. So the first choice to reach the scheduler stands
# for its group::
#
#     first arrival   judged, queued and admitted with the reservation of all n
#                     (never fits: 400 for the group; queue full: 429 for the group)
#     admitted        it runs; the group's hold keeps the other n - 1 reservations
#     later arrivals  admitted from the hold at once (the route may send them only
#                     after the first is prefilled, to share its cached prompt)
#     refused         later arrivals get the same refusal
#     abandoned       members cancelled before they arrive give their share back
#
# The route builds one :class:`~server.protocol.ChoiceGroup` per prompt and
# sets it on each of its choices' requests (``GenerationRequest.choices``).


def times(reservation: Reservation, n: int) -> Reservation:
    """``n`` requests' worth of ``reservation``."""
    return Reservation({s: blocks * n for s, blocks in reservation.per_stream.items()})


@dataclass(slots=True)
class GroupHold:
    """The scheduler's record of one group.

    Attributes:
        per_member: One choice's reservation.
        max_tokens: One choice's ``max_tokens`` (an omitted one lowered to the room).
        entry: The group's place in the waiting queue (its first arrival), until admitted.
        arrived: Other members that arrived while the group waited.
        seen: Members that reached the scheduler so far.
        admitted: The group was admitted: the hold reserves for members to come.
        refused: Why the group was refused; later arrivals get the same.
    """

    per_member: Reservation
    max_tokens: int
    entry: RequestState | None = None
    arrived: list[RequestState] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    admitted: bool = False
    refused: Rejected | None = None

    def unclaimed(self, group: ChoiceGroup) -> list[GenerationRequest]:
        """Members the hold still reserves for: not arrived, not cancelled."""
        return [r for r in group.members if id(r) not in self.seen and not r.cancelled.is_set()]



class ChoiceHolds:
    """Every choice group the scheduler has seen, and the choices ready to start.

    Args:
        reject: Refuses a request that never ran, given its record (the scheduler's
            ``reject``: the record is done).
        dropped: Counts a waiting request whose client left (nothing is sent to it).
        queue_timeout_s: How long a choice may wait (``limits.queue_timeout_s``).
    """

    def __init__(self, reject: Callable[..., None], dropped: Callable[..., None],
                 queue_timeout_s: float) -> None:
        self.reject, self.dropped, self.timeout = reject, dropped, queue_timeout_s
        self.holds: dict[ChoiceGroup, GroupHold] = {}
        # Choices of admitted groups, waiting only for a batch slot (blocks reserved).
        self.ready: deque[RequestState] = deque()

    def __contains__(self, group: ChoiceGroup) -> bool:
        return group in self.holds

    def open(self, group: ChoiceGroup, request: GenerationRequest, per_member: Reservation,
             entry: RequestState | None = None, refused: Rejected | None = None) -> None:
        """The group's first arrival: queued as ``entry``, or refused (and so the group)."""
        self.holds[group] = GroupHold(per_member, request.params.max_tokens, entry,
                                      seen={id(request)}, refused=refused)

    def join(self, state: RequestState) -> None:
        """A later choice: refused as its group was, or on its way with it."""
        request = state.request
        hold = self.holds[request.choices]
        hold.seen.add(id(request))
        if hold.refused is not None:
            self.reject(state, hold.refused, 0.0)
            return
        if hold.max_tokens < request.params.max_tokens:  # lowered for the group's first
            request.params = replace(request.params, max_tokens=hold.max_tokens)
        state.queued(hold.per_member, time.monotonic(), self.timeout)
        (self.ready if hold.admitted else hold.arrived).append(state)

    def admitted(self, entry: RequestState) -> None:
        """The group ``entry`` stands for starts: ``entry`` runs on one choice's
        reservation, the hold keeps the others', arrived choices become ready."""
        hold = self.holds[entry.group]
        entry.reservation, hold.admitted, hold.entry = hold.per_member, True, None
        self.ready.extend(hold.arrived)
        hold.arrived = []

    def refit(self, entry: RequestState, per_member: Reservation) -> None:
        """A waiting group's choices after a resize (``max_tokens`` possibly lowered)."""
        hold = self.holds[entry.group]
        hold.per_member, hold.max_tokens = per_member, entry.request.params.max_tokens

    def refuse(self, entry: RequestState, event: Rejected, waited: float) -> None:
        """The group ``entry`` stands for is refused: its arrived choices too, later ones
        when they come."""
        hold = self.holds.get(entry.group)
        if hold is None:
            return
        for pending in hold.arrived:
            self.reject(pending, event, waited)
        hold.entry, hold.arrived, hold.refused = None, [], event

    def expire(self) -> None:
        """Cancelled choices leave; groups whose every choice arrived or left are forgotten."""
        for pending in [p for p in self.ready if p.request.cancelled.is_set()]:
            self.ready.remove(pending)
            self.dropped(pending)
        for group, hold in list(self.holds.items()):
            for pending in [p for p in hold.arrived if p.request.cancelled.is_set()]:
                hold.arrived.remove(pending)
                self.dropped(pending)
            if hold.entry is None and not hold.unclaimed(group):
                del self.holds[group]

    def reserved(self) -> dict[str, int]:
        """Per stream, blocks held for choices of admitted groups that do not run yet."""
        out: dict[str, int] = {}
        reservations = [times(hold.per_member, len(hold.unclaimed(group)))
                        for group, hold in self.holds.items() if hold.admitted]
        reservations += [pending.reservation for pending in self.ready]
        for reservation in reservations:
            for stream, blocks in reservation.per_stream.items():
                out[stream] = out.get(stream, 0) + blocks
        return out

    def close(self, event: Rejected) -> None:
        """Refuse every ready choice and every choice still to come (the server drains)."""
        now = time.monotonic()
        while self.ready:
            pending = self.ready.popleft()
            self.reject(pending, event, now - pending.submitted_at)
        for hold in self.holds.values():
            hold.refused = event
