"""The answer's reasoning apart from its content: ``reasoning_content`` (vLLM's name).

For a model with think tags (``Engine.thinking``) the text inside
the think block is the reasoning and the rest the content, in whole answers
and streams alike (the same splitter runs over both):

- the answer starts inside the block when the generation prompt opened it
  (DeepSeek-R1, Qwen3's thinking releases); else a block opens only at the
  start of the answer, so a model that mentions ``<think>`` mid-answer is not
  split;
- a tag written over several tokens is held back until it is whole, or
  until it cannot be one any more;
- with no closing tag everything after the opening is reasoning, and the
  answer ends as it ends (its content is empty);
- after the closing tag everything is content; the newlines templates put
  right after a tag are dropped.

Output under a grammar (``response_format``, a forced tool call) is never
split: the grammar leaves the model no room to think. With
``server.reasoning_parser = "none"`` nothing is split.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from server.protocol import (
    ChatPrompt,
    ThinkTags,
)


class _At(enum.Enum):
    START = "start"  # nothing but whitespace yet: a think block may open
    THINKING = "thinking"  # inside the block
    ANSWER = "answer"  # after it, or an answer that never opened one


class ReasoningSplit:
    """One choice's text, fed piece by piece, as reasoning and content pieces.

    Args:
        tags: The model's think tags.
        inside: The answer starts inside a think block (the prompt opened it).
    """

    __slots__ = ("tags", "_at", "_held", "_trim")

    def __init__(self, tags: ThinkTags, inside: bool) -> None:
        self.tags = tags
        self._at = _At.THINKING if inside else _At.START
        self._held = ""  # text that may still be (part of) a tag
        self._trim = inside  # drop newlines right after a tag

    def feed(self, text: str) -> tuple[str, str]:
        """Add ``text``; return the (reasoning, content) safe to send now."""
        buf, self._held = self._held + text, ""
        if self._at is _At.START:
            buf = self._open(buf)
        if self._at is _At.THINKING:
            reasoning, buf = self._think(buf)
            return reasoning, self._trimmed(buf)
        return "", self._trimmed(buf)

    def finish(self, text: str = "") -> tuple[str, str]:
        """Add the answer's last ``text``; return it and everything held, as (reasoning,
        content)."""
        reasoning, content = self.feed(text)
        held, self._held = self._held, ""
        if self._at is _At.THINKING:
            return reasoning + self._trimmed(held), content
        return reasoning, content + held

    def _open(self, buf: str) -> str:
        """At the start: enter the block when the answer opens with its tag (held while
        it may); what comes after the tag is returned for the block."""
        body = buf.lstrip()
        if body.startswith(self.tags.start):
            self._at, self._trim = _At.THINKING, True
            return body[len(self.tags.start):]
        if self.tags.start.startswith(body):  # empty, or the tag's beginning
            self._held = buf
            return ""
        self._at = _At.ANSWER
        return buf

    def _think(self, buf: str) -> tuple[str, str]:
        """Inside the block: (reasoning, text after the closing tag)."""
        end = buf.find(self.tags.end)
        if end >= 0:
            reasoning = self._trimmed(buf[:end])
            self._at, self._trim = _At.ANSWER, True
            return reasoning, buf[end + len(self.tags.end):]
        keep = _partial_tag(buf, self.tags.end)
        self._held = buf[len(buf) - keep:]
        return self._trimmed(buf[:len(buf) - keep]), ""

    def _trimmed(self, text: str) -> str:
        """``text`` less the newlines right after a tag (until other text comes)."""
        if not self._trim or not text:
            return text
        text = text.lstrip("\n")
        self._trim = not text
        return text


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be completed)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True, slots=True)
class Thinking:
    """How one request's answers split: the tags, and whether they start inside a block."""

    tags: ThinkTags
    inside: bool

    def splitter(self) -> ReasoningSplit:
        """A splitter for one streamed choice."""
        return ReasoningSplit(self.tags, self.inside)

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer as (reasoning, content)."""
        return self.splitter().finish(text)


def thinking_of(engine: Any, settings: Any, prompt: ChatPrompt,
                constrained: bool) -> Thinking | None:
    """How the answers to ``prompt`` split, or None to leave them whole: reasoning split
    off (``server.reasoning_parser = "none"``), output under a grammar, or a model
    without think tags."""
    if settings.server.reasoning_parser == "none" or constrained:
        return None
    found = engine.thinking(prompt.template_kwargs)
    return None if found is None else Thinking(*found)
