"""Each token's own bytes, for the ``bytes`` of chat log-probabilities.

A token may hold part of a character: SmolLM2 writes "🎉" as three tokens of one,
two and one bytes. Decoded alone such a token is U+FFFD, so bytes taken from its
decoded text would be those of U+FFFD, and the ``bytes`` of an answer's tokens, joined,
would not be its text. OpenAI's ``bytes`` are the token's own UTF-8 bytes, which is
what lets a client put split characters back together; they come from the
vocabulary here:

- byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen): each vocabulary
  character stands for one byte (:func:`byte_level_alphabet`);
- SentencePiece with byte fallback (Llama 2, Mistral): ``<0xE6>`` is that byte,
  ``▁`` a space;
- anything else, and special tokens: the token's decoded text, encoded.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"  # SentencePiece's word boundary


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) are written as
    themselves; every other byte (controls, space, DEL, NBSP, soft hyphen) as the
    character 256 + k, k counting those bytes in order, so a space is ``Ġ`` (U+0120).
    """
    kept = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in kept:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


class TokenBytes:
    """``token_bytes(id)``: the bytes token ``id`` adds to the text.

    Args:
        tokenizer: mlx-lm's tokenizer wrapper, or a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self._decode = tokenizer.decode
        self._scheme = _scheme(self._tokenizer)
        special = getattr(self._tokenizer, "all_special_ids", None) or ()
        self._special = set(special)

    def __call__(self, token_id: int) -> bytes:
        if self._scheme is not None and token_id not in self._special:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                raw = self._from_piece(piece)
                if raw is not None:
                    return raw
        return self._decode([token_id]).encode("utf-8", "replace")

    def text(self, token_id: int) -> str:
        """Token ``id``'s text as the log-probability ``token`` strings show it.

        The tokenizer's own ``decode([id])``, except for SentencePiece (byte
        fallback) vocabularies, whose decoder strips the first space of a text:
        alone, "▁Paris" would read "Paris", and the tokens' strings would no
        longer join to the text they make. Their bytes are the token's own.
        """
        if self._scheme == "byte_fallback" and token_id not in self._special:
            return self(token_id).decode("utf-8", "replace")
        return self._decode([token_id])

    def _from_piece(self, piece: str) -> bytes | None:
        if self._scheme == "byte_level":
            alphabet = byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
            return None  # an added token written as plain text
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(_SPACE_MARK, " ").encode()


def _scheme(tokenizer: Any) -> str | None:
    """``"byte_level"``, ``"byte_fallback"`` or None, from a fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, AttributeError):
        return None
    decoders = _decoder_types(spec.get("decoder"))
    if "ByteLevel" in decoders:
        return "byte_level"
    if "ByteFallback" in decoders:
        return "byte_fallback"
    return None


def _decoder_types(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    types = {decoder.get("type")}
    for inner in decoder.get("decoders") or ():
        types |= _decoder_types(inner)
    return types


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
