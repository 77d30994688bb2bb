"""One JSON line per request end, on the ``veloxquant.requests`` logger.

A line for every generation request the engine saw, whatever ended it::

    {"event": "request_end", "ts": 1796037977.12, "request_id": "cmpl-...", "owner": 7,
     "status": 200, "finish_reason": "length", "prompt_tokens": 12, "completion_tokens": 30,
     "blocks_peak": 16, "ttft_s": 0.021, "latency_s": 0.212}

``status`` is the HTTP status the request's answer carries (499: the client
left first; for a stream already answered 200, the status its error frame
carries), as :mod:`server.http.errors` maps the engine's reasons. Requests
refused before running (400 too large, 429 queue full or timed out) log
``owner`` null and ``finish_reason`` "rejected" with their ``code``, and, once
tokenized, their ``prompt_tokens`` and ``latency_s`` (the wait in the queue). Lines
hold ids and counts only, never prompts, output or headers, so no secret can
reach them. The engine thread writes them when a request ends (the app hangs
a :class:`RequestLog` on the engine's metrics), not per token.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from server.http.errors import end_status, status_of
from server.protocol import FinishReason
from server.refusal import Reason

LOGGER_NAME = "veloxquant.requests"
log = logging.getLogger(LOGGER_NAME)

class _MessageOnly(logging.Formatter):
    """The record's message alone: the line is the JSON object, nothing around it."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()


def configure(enabled: bool, stream: TextIO | None = None) -> None:
    """Send request lines to ``stream`` (stderr) as bare JSON, or turn them off.

    The logger's own level is INFO whatever ``server.log_level`` says, so an
    operator who quiets the server's logs keeps the request lines; only
    ``server.request_log`` turns them off. Turned off, its level
    is above every record's: ``disabled`` would not last, since uvicorn's
    ``dictConfig`` sets it back to False on every logger it does not name.
    """
    for handler in list(log.handlers):
        log.removeHandler(handler)
    log.setLevel(logging.INFO if enabled else logging.CRITICAL + 1)
    log.propagate = False  # the root handler would wrap the JSON in its text format
    if enabled:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(_MessageOnly())
        log.addHandler(handler)


def _emit(fields: dict[str, Any]) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(json.dumps({"event": "request_end", "ts": round(time.time(), 3), **fields},
                            separators=(", ", ": ")))


class RequestLog:
    """Writes a line for each request end the engine's metrics record."""

    def finished(self, state: Any, reason: FinishReason, kv_blocks: int,
                 failure: Reason | None = None) -> None:
        """A request that ran ended (``state`` is the engine's RequestState)."""
        now = time.monotonic()
        first = state.first_token_at
        _emit({
            "request_id": state.request.request_id,
            "owner": state.owner,
            "status": end_status(reason, failure),
            "finish_reason": reason.value,
            "prompt_tokens": len(state.prompt_ids),
            "completion_tokens": state.generated,
            "blocks_peak": kv_blocks,
            "ttft_s": None if first is None else round(first - state.submitted_at, 4),
            "latency_s": round(now - state.submitted_at, 4),
        })

    @staticmethod
    def scored(request_id: str, status: int, prompt_tokens: int | None, started: float,
               code: str | None = None) -> None:
        """A completions ``echo`` request whose prompts were scored and nothing generated
        (``max_tokens: 0``), or that ended while they were scored: no generation of the
        engine's writes its line. It holds no blocks (``owner`` null)."""
        _emit({
            "request_id": request_id,
            "owner": None,
            "status": status,
            "finish_reason": "length" if status == 200 else "rejected" if code else None,
            **({"code": code} if code else {}),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "blocks_peak": 0,
            "ttft_s": None,
            "latency_s": round(time.monotonic() - started, 4),
        })

    def rejected(self, request: Any, reason: Reason, prompt_tokens: int | None = None,
                 waited_s: float | None = None) -> None:
        """A request refused before it ran (``request`` is the GenerationRequest)."""
        _emit({
            "request_id": request.request_id,
            "owner": None,
            "status": status_of(reason),
            "finish_reason": "rejected",
            "code": reason.value,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "blocks_peak": 0,
            "ttft_s": None,
            "latency_s": None if waited_s is None else round(waited_s, 4),
        })
