"""The ``n`` choices of one prompt: admitted together or refused at once, never half-started.

Each choice is its own engine request (owner, blocks, sampler), but admitting
them one by one let 15 of 16 start and the 16th wait at the head of the
queue, holding back every other client with most of the pool reserved, until
its 429 threw the 15 away. So the first choice to reach the scheduler stands
for its group::

    first arrival   judged, queued and admitted with the reservation of all n
                    (never fits: 400 for the group; queue full: 429 for the group)
    admitted        it runs; the group's hold keeps the other n - 1 reservations
    later arrivals  admitted from the hold at once (the route may send them only
                    after the first is prefilled, to share its cached prompt)
    refused         later arrivals get the same refusal
    abandoned       members cancelled before they arrive give their share back

The route builds one :class:`~server.engine.protocol.ChoiceGroup` per prompt and
sets it on each of its choices' requests (``GenerationRequest.choices``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from server.engine.capacity import Reservation
from server.engine.protocol import ChoiceGroup, GenerationRequest, Rejected
from server.engine.request_state import PendingRequest


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
    entry: PendingRequest | None = None
    arrived: list[PendingRequest] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    admitted: bool = False
    refused: Rejected | None = None

    def unclaimed(self, group: ChoiceGroup) -> list[GenerationRequest]:
        """Members the hold still reserves for: not arrived, not cancelled."""
        return [r for r in group.members if id(r) not in self.seen and not r.cancelled.is_set()]



class ChoiceHolds:
    """Every choice group the scheduler has seen, and the choices ready to start.

    Args:
        reject: Refuses a request that never ran (the scheduler's ``reject``).
        dropped: Counts a waiting request whose client left (nothing is sent to it).
        queue_timeout_s: How long a choice may wait (``limits.queue_timeout_s``).
    """

    def __init__(self, reject: Callable[..., None], dropped: Callable[..., None],
                 queue_timeout_s: float) -> None:
        self.reject, self.dropped, self.timeout = reject, dropped, queue_timeout_s
        self.holds: dict[ChoiceGroup, GroupHold] = {}
        # Choices of admitted groups, waiting only for a batch slot (blocks reserved).
        self.ready: deque[PendingRequest] = deque()

    def __contains__(self, group: ChoiceGroup) -> bool:
        return group in self.holds

    def open(self, group: ChoiceGroup, request: GenerationRequest, per_member: Reservation,
             entry: PendingRequest | None = None, refused: Rejected | None = None) -> None:
        """The group's first arrival: queued as ``entry``, or refused (and so the group)."""
        self.holds[group] = GroupHold(per_member, request.params.max_tokens, entry,
                                      seen={id(request)}, refused=refused)

    def join(self, request: GenerationRequest, ids: list[int]) -> None:
        """A later choice: refused as its group was, or on its way with it."""
        hold = self.holds[request.choices]
        hold.seen.add(id(request))
        if hold.refused is not None:
            self.reject(request, hold.refused, len(ids), 0.0)
            return
        if hold.max_tokens < request.params.max_tokens:  # lowered for the group's first
            request.params = replace(request.params, max_tokens=hold.max_tokens)
        now = time.monotonic()
        pending = PendingRequest(request, ids, hold.per_member, now, now + self.timeout)
        (self.ready if hold.admitted else hold.arrived).append(pending)

    def admitted(self, entry: PendingRequest) -> None:
        """The group ``entry`` stands for starts: ``entry`` runs on one choice's
        reservation, the hold keeps the others', arrived choices become ready."""
        hold = self.holds[entry.group]
        entry.reservation, hold.admitted, hold.entry = hold.per_member, True, None
        self.ready.extend(hold.arrived)
        hold.arrived = []

    def refit(self, entry: PendingRequest, per_member: Reservation) -> None:
        """A waiting group's choices after a resize (``max_tokens`` possibly lowered)."""
        hold = self.holds[entry.group]
        hold.per_member, hold.max_tokens = per_member, entry.request.params.max_tokens

    def refuse(self, entry: PendingRequest, event: Rejected, waited: float) -> None:
        """The group ``entry`` stands for is refused: its arrived choices too, later ones
        when they come."""
        hold = self.holds.get(entry.group)
        if hold is None:
            return
        for pending in hold.arrived:
            self.reject(pending.request, event, len(pending.prompt_ids), waited)
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
            self.reject(pending.request, event, len(pending.prompt_ids),
                        now - pending.enqueued_at)
        for hold in self.holds.values():
            hold.refused = event
