"""Sound "too long" verdicts before the costly work: a conversation before its chat
template runs, and a text prompt before it is tokenized (further down).

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
  (:mod:`server.text.bounds`) and a character is at least one byte, so
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

import json
import logging
from typing import Any

from server.protocol import (
    ChatPrompt,
    ConversationBound,
)
from server.text.chat_render import render_ids

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
            (:func:`server.text.bounds.max_bytes_per_token`), or None.
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



# A sound "too long" verdict on a text prompt from its byte count alone.
#
# Tokenizing a 1 MiB prompt takes about a second; refusing it for being over
# ``limits.max_prompt_tokens`` should not. A token stands for at most ``B``
# bytes of input, ``B`` the longest entry of the vocabulary (added tokens
# included) in UTF-8. If every input byte ends up inside some token, then::
#
#     tokens >= bytes / B        so   bytes > max_prompt_tokens * B  proves "too long"
#
# The premise only holds for tokenizers that cannot drop or shrink input, so
# the bound is derived only when the tokenizer's own description shows that:
#
# - no normalizer, or only ones that never shorten text (``Prepend``, a
#   ``Replace`` whose replacement is not shorter than its pattern);
# - pre-tokenizers that keep every byte (``ByteLevel``, ``Metaspace``,
#   ``Digits``, ``Split`` that does not remove its matches);
# - every byte has a token: a ``ByteLevel`` pre-tokenizer or a BPE/Unigram
#   model with ``byte_fallback`` (an unknown-token fallback may swallow a
#   whole word, so it does not count);
# - no added token strips the whitespace around it (``lstrip``/``rstrip``
#   would let one token absorb unboundedly many spaces).
#
# Otherwise :func:`max_bytes_per_token` returns None and every prompt is
# tokenized (off the engine thread) before its length is judged. UTF-8 byte
# lengths of vocabulary strings over-count what byte-level tokens cover (their
# printable stand-ins take 1-2 bytes for 1 input byte), which errs on the
# safe side.

_KEEPING_PRE = {"ByteLevel", "Metaspace", "Digits", "Split"}


def _parts(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get(key, []) for p in _parts(child, key)]
    return [node]


def _never_shortens(normalizer: dict[str, Any]) -> bool:
    kind = normalizer.get("type")
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return "String" in pattern and \
            len(normalizer.get("content", "").encode()) >= len(pattern["String"].encode())
    return False


def _keeps_bytes(pre: dict[str, Any]) -> bool:
    kind = pre.get("type")
    return kind in _KEEPING_PRE and not (kind == "Split" and pre.get("behavior") == "Removed")


def _is_lossless(spec: dict[str, Any]) -> bool:
    normalizers = _parts(spec.get("normalizer"), "normalizers")
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    model = spec.get("model") or {}
    every_byte = any(p.get("type") == "ByteLevel" for p in pre) or (
        model.get("type") in ("BPE", "Unigram") and model.get("byte_fallback") is True)
    stripping = any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))
    return (every_byte and not stripping and all(_never_shortens(n) for n in normalizers)
            and all(_keeps_bytes(p) for p in pre))


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most input bytes one token can cover, or None when no sound bound exists.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (or a Hugging Face fast tokenizer).
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else None
        vocab = hf.get_vocab()
    except Exception:  # an unusual tokenizer: no pre-check, tokenize everything
        return None
    if not spec or not vocab or not _is_lossless(spec):
        return None
    return max(len(token.encode()) for token in vocab)
