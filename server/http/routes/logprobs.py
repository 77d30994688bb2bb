"""The two ``logprobs`` shapes: legacy completions (parallel lists) and chat (entries).

Invariant of both: the token strings, joined, are the choice's text (the
first generated token keeps its leading space: server.text.token_bytes.prime),
and a legacy ``text_offset`` is each token's position in that text, except
where a token holds part of a character: its string is then U+FFFD. Chat's
``bytes``, joined, are the text's UTF-8 even then.
"""

from __future__ import annotations

from typing import Any

from server.protocol import (
    TokenLogprob,
    TopLogprob,
)


class LegacyLogprobs:
    """Builds one choice's legacy ``logprobs`` objects, keeping ``text_offset`` running
    across the pieces of the choice (echoed prompt, then each streamed token)."""

    def __init__(self) -> None:
        self.offset = 0

    def chunk(self, records: list[TokenLogprob], first: str | None = None) -> dict[str, Any]:
        """The object for ``records``; ``first`` is an unscored leading token (echo).

        An echoed prompt's first token has no context to be scored in: it is
        listed with a ``null`` log-probability and ``null`` alternatives, as
        OpenAI answers.
        """
        tokens: list[str] = [] if first is None else [first]
        values: list[float | None] = [] if first is None else [None]
        tops: list[dict[str, float] | None] = [] if first is None else [None]
        for record in records:
            tokens.append(record.token)
            values.append(record.logprob)
            tops.append({t.token: t.logprob for t in record.top})
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def merge_legacy(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate legacy ``logprobs`` objects of consecutive pieces of one choice."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [value for part in parts for value in part[key]] for key in keys}


def chat_entry(record: TokenLogprob) -> dict[str, Any]:
    """One ``logprobs.content`` entry of a chat answer.

    ``bytes`` are the token's own (``raw``), part of a character where the token
    holds one; joined over an answer they are its text's UTF-8, which the ``token``
    strings are not when a character is split (such a token decodes to U+FFFD).
    """
    return {
        "token": record.token,
        "logprob": record.logprob,
        "bytes": list(_raw(record)),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(_raw(t))}
                         for t in record.top],
    }


def _raw(record: TokenLogprob | TopLogprob) -> bytes:
    return record.raw if record.raw is not None else record.token.encode()
