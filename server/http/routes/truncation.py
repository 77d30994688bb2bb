"""``truncation: "auto"`` of the Responses API, in a bounded number of renders.

The oldest input items go, one at a time, while the rest leaves the context
no room. System and developer messages (``instructions`` among them) and the
last item stay, and a tool result whose call went goes with it: so the
droppable items form *units* (an item and the tool results right after it),
dropped oldest first.

Trying one unit fewer per admission renders the whole conversation once per
dropped unit: thousands of renders for a long conversation, minutes of a
prompt worker. So the units that must go are found first without admitting:

1. by the conversation bound (:mod:`server.text.bounds`, no rendering):
   the oldest units go while the rest cannot possibly fit;
2. after the first refusal over the context, by a binary search over the
   number of units dropped, on the rendered prompt's token count: the fewest
   that leave at most ``limits.max_prompt_tokens`` tokens and room for the
   answer in the context. Fewer could never be admitted, so starting there
   drops what one unit at a time would (about log2(units) renders).

Admission then goes on one unit at a time, as it did, for what only admission
knows (the KV pool).
"""

from __future__ import annotations

import asyncio
from typing import Any

from server.http.errors import engine_error
from server.http.routes.conversation import NOTHING, message_size, served_bound
from server.http.schemas.chat import ChatMessage
from server.protocol import ChatPrompt, ConversationBound, ConversationSize, SamplingParams
from server.refusal import Rejected

# Roles that are never dropped.
PINNED_ROLES = ("system", "developer")


def drop_units(messages: list[ChatMessage]) -> list[range]:
    """The droppable items, oldest first, each with the tool results right after it."""
    last, units, i = len(messages) - 1, [], 0
    while i < last:
        if messages[i].role in PINNED_ROLES:
            i += 1
            continue
        end = i + 1
        while end < last and messages[end].role == "tool":
            end += 1
        units.append(range(i, end))
        i = end
    return units


def kept_indices(n: int, units: list[range], dropped: int) -> list[int]:
    """Indices of ``n`` messages left once the oldest ``dropped`` units go."""
    gone = {i for unit in units[:dropped] for i in unit}
    return [i for i in range(n) if i not in gone]


def without_oldest(messages: list[ChatMessage], dropped: int = 1) -> list[ChatMessage] | None:
    """``messages`` less their ``dropped`` oldest units, or None when there are fewer."""
    units = drop_units(messages)
    if len(units) < dropped:
        return None
    return [messages[i] for i in kept_indices(len(messages), units, dropped)]


def trimmed_to_fit(engine: Any, messages: list[ChatMessage]) -> list[ChatMessage]:
    """``messages`` less the oldest units that must go before the rest may fit the
    conversation bound (none rendered).

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``messages``, when even the
            messages that are never dropped cannot fit.
    """
    bound = served_bound(engine)
    sizes = [message_size(m.role, m.content) for m in messages]
    if bound is None or bound.fits(sum(sizes, NOTHING)):
        return messages
    units = drop_units(messages)
    droppable = {i for unit in units for i in unit}
    kept = sum((s for i, s in enumerate(sizes) if i not in droppable), NOTHING)
    if (refusal := bound.refusal(kept, "messages")) is not None:
        raise engine_error(refusal)
    dropped = _units_past_bound(bound, units, sizes, kept)
    return [messages[i] for i in kept_indices(len(messages), units, dropped)]


def _units_past_bound(bound: ConversationBound, units: list[range],
                      sizes: list[ConversationSize], kept: ConversationSize) -> int:
    """How many of the oldest units must go: the newest stay while they may fit."""
    for k in range(len(units) - 1, -1, -1):
        unit = sum((sizes[i] for i in units[k]), NOTHING)
        if not bound.fits(kept + unit):
            return k + 1
        kept += unit
    return 0


async def fewest_to_drop(engine: Any, messages: list[ChatMessage], prompt: ChatPrompt,
                         params: SamplingParams, max_prompt_tokens: int
                         ) -> list[ChatMessage] | None:
    """``messages`` less the fewest oldest units whose rendered prompt has at most
    ``max_prompt_tokens`` tokens and leaves the answer room in the context (at least
    one unit: the whole conversation was refused); None when none can go.

    Args:
        engine: The engine (tokenizes on a worker thread).
        messages: The conversation that was refused over the context.
        prompt: ``messages`` as built for the engine (one rendered dict each).
        params: The request's sampling parameters (``max_tokens``).
        max_prompt_tokens: ``limits.max_prompt_tokens``.
    """
    units = drop_units(messages)
    if not units:
        return None
    limit = _token_limit(engine, params, max_prompt_tokens)
    low, high = 1, len(units)
    while low < high:
        mid = (low + high) // 2
        if await _may_fit(engine, prompt, kept_indices(len(messages), units, mid), limit):
            high = mid
        else:
            low = mid + 1
    return [messages[i] for i in kept_indices(len(messages), units, low)]


def _token_limit(engine: Any, params: SamplingParams, max_prompt_tokens: int) -> int:
    """The most prompt tokens that admission may take: within the prompt limit, and
    leaving the context room for ``max_tokens`` (one token when the client left it
    out: it is lowered to the room left)."""
    context = getattr(engine, "context_length", None)
    if context is None:
        return max_prompt_tokens
    answer = 1 if params.max_tokens_defaulted else params.max_tokens
    return min(max_prompt_tokens, context - answer)


async def _may_fit(engine: Any, prompt: ChatPrompt, kept: list[int], limit: int) -> bool:
    """Whether the prompt of the ``kept`` messages has at most ``limit`` tokens (True
    when it cannot be rendered: admission reports that)."""
    shorter = ChatPrompt(tuple(prompt.messages[i] for i in kept), prompt.tools)
    ids = await asyncio.to_thread(engine.tokenize, shorter)
    return isinstance(ids, Rejected) or len(ids) <= limit
