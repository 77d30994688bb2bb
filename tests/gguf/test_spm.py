"""SentencePiece vocabularies from GGUF metadata tokenize as SentencePiece itself does.

The reference is the ``sentencepiece`` library with a BPE model trained here
the way Llama's and Mistral's were set up (byte fallback, no normalization,
a dummy space prefix), written into a GGUF file the way llama.cpp's converter
writes one: each piece, its score and its type.
"""

from __future__ import annotations

import json

import mlx_lm
import pytest
import sentencepiece as spm

from tests.gguf import synth
from veloxquant_mlx.gguf import convert_gguf
from veloxquant_mlx.gguf.spm import spm_merges

TEXTS = [
    "Hello world",
    "  two leading spaces and  a double space",
    "Line one\nLine two\n\n\tTabbed",
    "Numbers 3.14159 and 2024-12-02",
    "naïve café, façade; Übermaß",
    "数据 and emoji 🎉🚀 fall back to bytes",
    "",
    " ",
]


@pytest.fixture(scope="module")
def processor() -> spm.SentencePieceProcessor:
    return synth.train_sentencepiece()


@pytest.fixture(scope="module")
def spm_folder(processor, tmp_path_factory):
    vocab = synth.sentencepiece_vocabulary(processor)
    folder = tmp_path_factory.mktemp("spm")
    path = synth.write_model(folder / "spm.gguf",
                             synth.Spec("Q8_0", tokenizer_model="llama", spm=vocab))
    return convert_gguf(path, folder / "cache")


@pytest.fixture(scope="module")
def tokenizer(spm_folder):
    return mlx_lm.load(str(spm_folder))[1]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_sentencepiece(tokenizer, processor, text):
    assert tokenizer.encode(text, add_special_tokens=False) == processor.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decoding_gives_the_text_back(tokenizer, processor, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == processor.decode(ids)
    if not text.startswith(" "):  # SentencePiece drops the one space it added
        assert tokenizer.decode(ids) == text


def test_added_pieces_split_the_text_as_llama_cpp_does(tokenizer, processor):
    """llama.cpp tokenizes the text on each side of an added piece on its own, and
    puts the space prefix in front of each (SentencePiece itself does not)."""
    tool = processor.piece_to_id("<tool>")
    ids = tokenizer.encode("user-defined <tool> stays whole", add_special_tokens=False)
    assert ids == [*processor.encode("user-defined "), tool, *processor.encode(" stays whole")]


def test_bos_and_special_pieces(tokenizer, processor):
    ids = tokenizer.encode("Hello")
    assert ids == [1, *processor.encode("Hello")]  # add_bos_token: <s> first
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token_ids == {2}
    text = "</s>"
    assert tokenizer.encode(text, add_special_tokens=False) == [2]  # control piece, whole


def test_streamed_text_uses_sentencepiece_detokenizer(tokenizer, processor):
    text = "Streamed naïve 🎉 text\nwith two lines"
    detokenizer = tokenizer.detokenizer
    assert type(detokenizer).__name__ == "SPMStreamingDetokenizer"
    detokenizer.reset()
    for token in processor.encode(text):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == text


def test_merges_rank_by_score_and_skip_control_pieces():
    pieces = ["<unk>", "<s>", "a", "b", "c", "ab", "bc", "abc", "<0x41>"]
    types = [2, 3, 1, 1, 1, 1, 1, 1, 6]
    scores = [0.0, 0.0, -5.0, -5.0, -5.0, -2.0, -1.0, -3.0, 0.0]
    merges = spm_merges(pieces, scores, types)
    # bc (-1) before ab (-2) before abc's two splits (-3), left part's id breaking the tie.
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_generation_config_names_bos_and_eos(spm_folder):
    generation = json.loads((spm_folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("text", ["Hello world", "naïve 🎉 数据\n\ttabs"])
def test_each_tokens_bytes_join_to_the_text(tokenizer, text):
    """Chat logprobs' ``bytes``: "▁" is a space, ``<0xNN>`` pieces are that byte."""
    from server.text.token_bytes import TokenBytes

    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not text.isascii():
        assert any(tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    assert b"".join(token_bytes(i) for i in ids) == (" " + text).encode()


def test_logprob_token_strings_keep_the_pieces_spaces(tokenizer):
    """Each token's string in log-probabilities joins to the text (decode([id]) alone
    strips a SentencePiece piece's leading space)."""
    from server.text.token_bytes import TokenBytes

    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode("Hello big world", add_special_tokens=False)
    assert "".join(token_bytes.text(i) for i in ids) == " Hello big world"
    assert token_bytes.text(1) == tokenizer.decode([1]) == "<s>"  # specials: their text


def test_chats_start_with_bos_once_as_llama_cpp_renders_them(tokenizer):
    """The vocabulary adds BOS to every text; a template without ``{{ bos_token }}``
    would leave chats without it (llama.cpp adds it to the rendered chat)."""
    from server.protocol import ChatPrompt
    from server.text.chat_render import render_ids

    chat = ChatPrompt(({"role": "user", "content": "Hello"},))
    ids = render_ids(tokenizer, chat)
    assert ids[0] == 1 and ids.count(1) == 1
    hf = tokenizer._tokenizer
    plain = hf.chat_template
    hf.chat_template = "{{ bos_token }}" + plain  # a template that writes it itself
    try:
        ids = render_ids(tokenizer, chat)
    finally:
        hf.chat_template = plain
    assert ids[0] == 1 and ids.count(1) == 1
