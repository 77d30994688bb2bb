"""A sound "too long" verdict on a conversation before its chat template runs.

Rendering tens of thousands of messages through a Jinja template and
tokenizing the result takes seconds of CPU, most of it holding the GIL, so
the engine thread and the event loop starve meanwhile. A conversation is
judged first from two counts that one pass over the request gives:

- messages: every message takes at least one token of the template's framing
  (ChatML's turn markers, Llama 3's headers), so a conversation of more than
  ``limits.max_prompt_tokens`` messages cannot fit. :func:`frames_every_message`
  checks that premise on the served template when the model loads; a template
  that writes bare text gets no count bound.
- characters: one token covers at most ``B`` bytes of text
  (:mod:`server.engine.prompt_bound`) and a character is at least one byte, so
  more than ``max_prompt_tokens * B`` characters of text the template writes
  cannot fit. Only text that templates write whole is counted: the content of
  every message but the assistant's (reasoning templates drop earlier
  reasoning from assistant turns), less the whitespace around it (``| trim``).
  Names and tool-call arguments are not counted: templates leave names out
  and re-serialize arguments.

Both counts are lower bounds of the rendered prompt's tokens, so a
conversation within them is rendered and tokenized in full, and judged by
its real token count.
"""

from __future__ import annotations

import logging
from typing import Any

from server.engine.chat_render import render_ids
from server.engine.protocol import (
    ChatPrompt,
    ConversationBound,
)

log = logging.getLogger("veloxquant.server")

# Turns of the probe conversation; the longer one has twice as many.
_PROBE_TURNS = 8


def conversation_bound(tokenizer: Any, max_prompt_tokens: int,
                       per_token: int | None) -> ConversationBound:
    """The bound for the served tokenizer and chat template (renders a short probe).

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (or a Hugging Face tokenizer).
        max_prompt_tokens: ``limits.max_prompt_tokens``.
        per_token: The most bytes one token covers
            (:func:`server.engine.prompt_bound.max_bytes_per_token`), or None.
    """
    framed = frames_every_message(tokenizer)
    if not framed:
        log.info("the chat template does not frame every message: long conversations are "
                 "judged after rendering")
    return ConversationBound(max_prompt_tokens, max_prompt_tokens if framed else None,
                             None if per_token is None else max_prompt_tokens * per_token,
                             per_token)


def frames_every_message(tokenizer: Any) -> bool:
    """Whether each message of a conversation adds at least one token to the rendered
    prompt, however short its content: empty user and assistant turns are rendered at
    two lengths, and the longer must be longer by at least its extra messages."""
    try:
        short, long = (len(render_ids(tokenizer, _probe(turns)))
                       for turns in (_PROBE_TURNS, 2 * _PROBE_TURNS))
    except Exception:  # a template that refuses the probe: no premise to rely on
        log.debug("the chat template refused the probe conversation", exc_info=True)
        return False
    return long - short >= _PROBE_TURNS


def _probe(turns: int) -> ChatPrompt:
    roles = ("user", "assistant")
    return ChatPrompt(tuple({"role": roles[i % 2], "content": ""} for i in range(turns)))
