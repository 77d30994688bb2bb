"""Tool calls read back from the model's text: whole answers and streams.

The model writes calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the convention :mod:`server.text.chat_render` teaches, and Hermes/Qwen
templates use), or as bare JSON, one object or a list (Llama 3.1 style; also
what a forced call is, since constrained decoding emits exactly that JSON).
A plan whose ``call_format`` names another syntax (Llama 3 JSON, Mistral,
pythonic: :mod:`server.http.routes.tool_formats`) is read in that one first.
A candidate counts as a call only when it parses, names an offered function
and has object arguments (``"parameters"`` is taken for ``"arguments"``);
anything else stays text, so a model that merely talks about JSON is not
turned into a call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.http.routes.tool_formats import SYNTAXES, call_from, tool_call
from server.http.schemas.tools import ToolPlan
from server.protocol import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)

_TAGGED = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) +
                     r"|\Z)", re.DOTALL)


def _bare(text: str, names: set[str]) -> list[dict[str, Any]]:
    """Calls when the whole text is one JSON call or a list of them; else none."""
    obj = _loads(text)
    calls = [call_from(o, names) for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(calls) else []


def _split(text: str, plan: ToolPlan) -> tuple[str, list[dict[str, Any]]]:
    """The text outside the calls (unstripped) and the calls, in order.

    A last tag that ``max_tokens`` cut inside its JSON is not content either: it
    is the call so far when its name was written (as a forced call cut short),
    else nothing (a half tag is markup, not text for the user); the whitespace
    before it, which ends the text, goes with it.
    """
    names = {f.name for f in plan.offered}
    own = SYNTAXES[plan.call_format].parse
    found = own(text, names) if own is not None else None
    if found is not None:
        return found
    calls = _bare(text.strip(), names)
    if calls:
        return "", calls
    kept, calls = [], []
    at = 0
    for match in _TAGGED.finditer(text):
        inside = match.group(1)
        cut = match.end() == len(text) and not text.endswith(TOOL_CALL_CLOSE)
        if cut:  # the cut may fall inside the closing tag, after a whole call
            inside = inside[:len(inside) - _tag_start_at_end(inside, TOOL_CALL_CLOSE)]
        call = call_from(_loads(inside), names)
        if call is None and not cut:
            continue  # not a call: stays text
        before = text[at:match.start()]
        kept.append(before.rstrip() if cut else before)
        at = match.end()
        calls += [call] if call is not None else _cut_call(inside, plan)
    return "".join(kept) + text[at:], calls


def _tag_start_at_end(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` begin ``tag`` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def whole_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]]:
    """The calls of ``text`` that are complete (parse and name an offered function)."""
    return [c for c in _split(text, plan)[1] if _loads(c["function"]["arguments"]) is not None]


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a finished answer into its text and its tool calls.

    Returns:
        ``(content, calls)``: with calls, content is the text outside them
        (None when only whitespace is left); with ``parallel_tool_calls: false``
        at most one call is kept.
    """
    kept, calls = _split(text, plan)
    if not calls:
        return (None, _cut_call(text, plan)) if plan.forced_call else (kept, [])
    # Trailing whitespace only (the stream cannot take back leading whitespace it sent).
    return (kept.rstrip() or None), calls if plan.parallel else calls[:1]


_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')


def _cut_call(text: str, plan: ToolPlan) -> list[dict[str, Any]]:
    """A forced call ``max_tokens`` cut short: the call so far, as OpenAI's API returns one.

    Its arguments are the JSON text written so far (it does not parse); the
    ``{"name": ..., "arguments": ...}`` wrapper is the server's own and never
    reaches the client as content. No call while the name itself is unfinished.
    """
    match = _CUT_CALL.match(text)
    if match is None or match.group(1) not in {f.name for f in plan.offered}:
        return []
    return [tool_call(match.group(1), text[match.end():])]


def _loads(text: str) -> Any:
    """The JSON value of ``text``, or None (also for nesting deeper than the parser goes)."""
    try:
        return json.loads(text.strip())
    except (ValueError, RecursionError):
        return None


def _held_from(text: str, sent: int, markers: tuple[str, ...]) -> int:
    """Where ``text`` must be held from: its first marker after ``sent``, else a tail
    that may begin one."""
    found = [at for marker in markers if (at := text.find(marker, sent)) >= 0]
    if found:
        return min(found)
    return len(text) - max(_tag_start_at_end(text[sent:], marker) for marker in markers)


class ToolStream:
    """One streamed choice's text, held back where it may be a tool call.

    Text is passed on as content until it could be the start of a call: a
    marker of the plan's syntax (``<tool_call>``, Mistral's ``[TOOL_CALLS]``) or
    the start of one at the end of what came so far, or an answer that opens
    (or may yet open) with what opens calls there (``{``, ``[``, ``<|python_tag|>``
    for Llama 3, ``<|python_start|>`` for pythonic). From there it is held, and
    :meth:`finish` says whether it was a call. A forced call is never content:
    :meth:`call_delta` streams it as OpenAI streams calls, its name (with the
    call's id) once the grammar's ``{"name": ..., "arguments": `` wrapper has
    it, then its arguments as they are written, all but the last character,
    which may be the wrapper's closing brace.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.syntax = SYNTAXES[plan.call_format]
        self.text = ""  # everything so far
        self.sent = 0  # characters of text already passed on as content
        self.call: dict[str, Any] | None = None  # a forced call whose name went out
        self.args_at = 0  # where its arguments start in text
        self.args_sent = 0  # characters of its arguments already sent

    def feed(self, piece: str) -> str:
        """Add generated text; returns what can be sent as content now."""
        self.text += piece
        if self.plan.forced_call or self._opens_call():
            return ""
        held = _held_from(self.text, self.sent, self.syntax.markers)
        # Whitespace waits for the text after it: before a call (or at the end of an
        # answer with calls) it is not content, as the non-streamed answer strips it.
        out = self.text[self.sent:held].rstrip()
        self.sent += len(out)
        return out

    def _opens_call(self) -> bool:
        """Whether the answer starts, or may yet start, with what opens calls there.

        Once text went out, its start opened nothing, and a longer start opens nothing either.
        """
        if self.sent:
            return False
        start = self.text.lstrip()
        return bool(start) and any(start.startswith(opener) or opener.startswith(start)
                                   for opener in self.syntax.openers)

    def call_delta(self) -> dict[str, Any] | None:
        """A forced call's next streamed piece (``delta.tool_calls[0]``), if one is ready."""
        if not self.plan.forced_call:
            return None
        piece: dict[str, Any] = {"index": 0}
        if self.call is None:
            match = _CUT_CALL.match(self.text)
            # Past the separator's whitespace: the arguments' first character is here.
            if (match is None or match.end() == len(self.text)
                    or match.group(1) not in {f.name for f in self.plan.offered}):
                return None
            self.call, self.args_at = tool_call(match.group(1), ""), match.end()
            # The name alone, arguments "" (as OpenAI's first piece); they follow.
            return {**piece, "id": self.call["id"], "type": "function",
                    "function": {"name": match.group(1), "arguments": ""}}
        ready = max(len(self.text) - 1 - self.args_at, self.args_sent)
        more = self.text[self.args_at + self.args_sent: self.args_at + ready]
        self.args_sent = ready
        if more:
            piece.setdefault("function", {})["arguments"] = more
        return piece if len(piece) > 1 else None

    def finish_call(self) -> tuple[dict[str, Any] | None, bool]:
        """At the end of a streamed forced call: its last piece, and whether it was whole.

        The arguments sent are exactly the model's text: the end strips the
        wrapper's closing brace of a whole call; a call ``max_tokens`` cut keeps all.
        """
        whole = bool(whole_calls(self.text, self.plan))
        args = self.text[self.args_at:]
        if whole:
            args = args.rstrip()[:-1]
        more = args[self.args_sent:]
        self.args_sent = len(args)
        return ({"index": 0, "function": {"arguments": more}} if more else None), whole

    def streamed_call(self) -> dict[str, Any]:
        """The forced call as streamed so far (after :meth:`finish_call`: the whole of it)."""
        assert self.call is not None, "no forced call has started streaming"
        arguments = self.text[self.args_at:self.args_at + self.args_sent]
        return {**self.call, "function": {**self.call["function"], "arguments": arguments}}

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: content not yet sent (text outside calls) and the calls."""
        kept, calls = _split(self.text, self.plan)
        if not calls and self.plan.forced_call:  # cut short: nothing of it was sent
            return "", _cut_call(self.text, self.plan)
        if not calls:
            return kept[self.sent:], []
        # What was sent all lies before the first call, so it is a prefix of ``kept``.
        return kept[self.sent:].rstrip(), calls if self.plan.parallel else calls[:1]
