"""A token's own bytes (server/text/token_bytes.py), for chat log-probabilities' ``bytes``.

The served case (SmolLM2 splitting emoji over tokens) is in test_real_model.py.
"""

from __future__ import annotations

import json

import pytest

from server.text.token_bytes import (
    TokenBytes,
    byte_level_alphabet,
)

TEXTS = ["plain words", " leading space", "🎉🚀 and 日本語", "naïve café\n\ttabs",
         "\x00\x7f\u00a0\u00ad", "€100 — ok?"]


def test_the_byte_level_alphabet_is_one_character_per_byte() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["\u0120"], alphabet["\u010a"], alphabet["A"], alphabet["\u00ff"]) == \
        (0x20, 0x0A, 0x41, 0xFF)  # "Ġ" is a space, "Ċ" a newline


@pytest.mark.parametrize("text", TEXTS)
def test_joined_bytes_of_a_texts_tokens_are_its_utf8(tiny_model, text: str) -> None:
    _, tokenizer = tiny_model
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == text.encode()
    split = [i for i in ids if tokenizer.decode([i]) == "\ufffd"]
    if any(ord(ch) > 0x7FF for ch in text):  # the tiny vocabulary splits these characters
        assert split and all(len(token_bytes(i)) < 3 for i in split)


def test_special_tokens_are_their_text(tiny_model) -> None:
    _, tokenizer = tiny_model
    token_bytes = TokenBytes(tokenizer)
    for token_id in tokenizer._tokenizer.all_special_ids:
        assert token_bytes(token_id) == tokenizer.decode([token_id]).encode()


class _SentencePieceLike:
    """What TokenBytes reads of a Llama-2-style fast tokenizer (byte fallback)."""

    all_special_ids = [1]
    pieces = {1: "<s>", 5: "<0xE6>", 6: "<0x97>", 7: "\u2581hello", 8: "world"}

    class backend_tokenizer:  # noqa: N801 (stands in for the tokenizers object)
        @staticmethod
        def to_str() -> str:
            return json.dumps({"decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip"}]}})

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        return "<s>" if ids == [1] else "\ufffd"


def test_byte_fallback_pieces_are_their_byte_and_the_word_mark_a_space() -> None:
    token_bytes = TokenBytes(_SentencePieceLike())
    assert [token_bytes(i) for i in (5, 6, 7, 8, 1)] == [b"\xe6", b"\x97", b" hello", b"world",
                                                          b"<s>"]


def test_an_unknown_scheme_falls_back_to_the_decoded_text() -> None:
    class Plain:
        def decode(self, ids: list[int]) -> str:
            return f"<{ids[0]}>"

    assert TokenBytes(Plain())(42) == b"<42>"
