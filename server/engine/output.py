"""Postprocessing of sampled tokens: detokenize, stop strings, limits, events.

Runs on the engine thread after each model call. The runner hands back bare
token ids (and, when asked for, the distribution each was drawn from); here
they become the client-facing :class:`~server.protocol.TokenEvent`
records, and a request is marked finished when it hits an end token, a stop
string or ``max_tokens``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from server.engine.sampling import finite_logprob
from server.protocol import (
    FinishReason,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)
from server.text.token_bytes import TokenBytes

if TYPE_CHECKING:
    from server.engine.request_state import RequestState


class OutputProcessor:
    """Turns each sampled token of a request into the event its client gets.

    Args:
        tokenizer: The model's tokenizer (each token's text and bytes for log-probabilities).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.token_bytes = TokenBytes(tokenizer)
        self.primer = primer_token(tokenizer)

    def accept(self, state: RequestState, token: int,
               logprobs: mx.array | None) -> TokenEvent | None:
        """Account for one generated token; set ``state.finish`` when the request is done.

        Args:
            state: The request.
            token: The sampled token id.
            logprobs: The ``(vocab,)`` log-probabilities it was drawn from, when
                the client asked for them.

        Returns:
            The event to send (None when nothing is to be sent for this token,
            e.g. the end token).
        """
        now = time.monotonic()
        if state.first_token_at is None:
            state.first_token_at = now
        state.prev_token_at = state.last_token_at
        state.last_token_at = now
        state.generated += 1
        if token in state.eos_ids:
            state.finish = FinishReason.STOP
            state.ended_on_eos = True
            held = state.stop.held_records()  # their text comes with the final flush
            return TokenEvent("", token, held) if held else None
        params = state.request.params
        logprob = None
        if params.logprobs and logprobs is not None:
            logprob = token_logprob(logprobs, token, params.top_logprobs, self.token_bytes)
        if not state.detokenizer.tokens:
            prime(state.detokenizer, self.primer)
        state.detokenizer.add_token(token)
        text, hit, records = state.stop.feed_token(state.detokenizer.last_segment, logprob)
        if hit:
            state.finish = FinishReason.STOP
        elif state.generated >= state.max_tokens:
            state.finish = FinishReason.LENGTH
            records += state.stop.held_records()  # their text comes with the final flush
        return TokenEvent(text, token, records)

    @staticmethod
    def final_text(state: RequestState) -> str:
        """Text still held back (detokenizer tail, partial stop match) at a normal end."""
        if state.tail_flushed or state.finish is None:
            return ""
        state.tail_flushed = True
        if state.finish is FinishReason.STOP and not state.ended_on_eos:
            return ""  # a stop string matched: everything after it is dropped
        state.detokenizer.finalize()
        text, hit = state.stop.feed(state.detokenizer.last_segment)
        return text if hit else text + state.stop.flush()


def primer_token(tokenizer: Any) -> int | None:
    """A token to feed a fresh streaming detokenizer before the first generated one.

    mlx-lm's streaming detokenizers drop the leading space of the first token
    they see (right for a whole text, wrong for a continuation): "Once upon a
    time" + " shapes" would come out as "shapes", while the log-probability tokens
    (``decode([id])``) say " shapes" and ``text_offset`` would point into a
    string that is not the text. Fed a plain one-token word first, the
    detokenizer has text already and keeps every space after it; the word's
    own text is skipped (:func:`prime`). This is the token of ``"a"`` when
    that is one token the detokenizer emits at once, else None (no priming).
    """
    try:
        ids = tokenizer.encode("a", add_special_tokens=False)
        if len(ids) != 1:
            return None
        probe = tokenizer.detokenizer
        probe.add_token(ids[0])
        return ids[0] if probe.text else None
    except Exception:  # an unusual tokenizer: keep mlx-lm's behaviour
        return None


def prime(detokenizer: Any, primer: int | None) -> None:
    """Feed ``primer`` to a fresh detokenizer and skip its text (see :func:`primer_token`)."""
    if primer is None:
        return
    detokenizer.add_token(primer)
    _ = detokenizer.last_segment  # advances past the primer's own text


def token_logprob(
    logprobs: mx.array, token_id: int, top_n: int, token_bytes: TokenBytes,
) -> TokenLogprob:
    """Log-probability of the chosen token and the ``top_n`` best alternatives.

    Args:
        logprobs: Normalized log-probabilities over the vocabulary ``(vocab,)``.
        token_id: The sampled token.
        top_n: How many alternatives to report (0 for none).
        token_bytes: A token id's own bytes, and its text (:meth:`TokenBytes.text`).
    """
    chosen = logprobs[token_id].item()
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = logprobs[ids]
        pairs = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: -p[1])
        top = tuple(TopLogprob(token_bytes.text(int(i)), finite_logprob(v), int(i),
                               token_bytes(int(i))) for i, v in pairs)
    return TokenLogprob(token_bytes.text(token_id), finite_logprob(chosen), token_id, top,
                        token_bytes(token_id))
