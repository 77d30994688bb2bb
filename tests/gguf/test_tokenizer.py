"""The tokenizer rebuilt from GGUF metadata behaves like the original."""

from __future__ import annotations

import json

import mlx_lm
import pytest

from veloxquant_mlx.gguf.tokenizer import pre_tokenizer_for

SPECIAL_TEXT = "<|im_start|>user\nhello <tool> world, 12345!<|im_end|>"


@pytest.fixture(scope="module")
def synth_tokenizer(synthetic_converted):
    return mlx_lm.load(str(synthetic_converted["Q8_0"]))[1]


def test_synthetic_round_trip_with_specials(synth_tokenizer):
    tok = synth_tokenizer
    ids = tok.encode(SPECIAL_TEXT, add_special_tokens=False)
    assert tok.decode(ids) == SPECIAL_TEXT
    assert ids[0] == 1 and ids[-1] == 2  # control tokens stay single tokens
    assert ids.count(279) == 1  # the user-defined <tool> too
    assert "hello" in tok.convert_ids_to_tokens(ids)  # merges applied
    # Control tokens are special (skipped), user-defined ones are not.
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello <tool> world, 12345!"


def test_synthetic_bos_added_once(synth_tokenizer):
    ids = synth_tokenizer.encode("hello world")
    assert ids[0] == 0 and ids.count(0) == 1  # add_bos_token is true in the file
    assert synth_tokenizer.bos_token == "<|endoftext|>"


def test_synthetic_eos_and_chat_template(synth_tokenizer, synthetic_converted):
    assert synth_tokenizer.eos_token_ids == {2}
    prompt = synth_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((synthetic_converted["Q8_0"] / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 2}


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("default", ["a", "Ġ", "123", "45"]),  # llama.cpp's: digits split, then by three
        (None, ["a", "Ġ", "123", "45"]),  # no name: llama.cpp's default
        ("gpt2", ["a", "Ġ12345"]),
        ("gpt-2", ["a", "Ġ12345"]),
        ("smollm", ["a", "Ġ", "1", "2", "3", "4", "5"]),
        ("deepseek-r1-qwen", ["a", "Ġ", "1", "2", "3", "4", "5"]),  # qwen2's
        ("llama-bpe", ["a", "Ġ", "123", "45"]),
        ("qwen2", ["a", "Ġ", "1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizer_digit_grouping(pre, pieces):
    got = [piece for piece, _ in pre_tokenizer_for(pre).pre_tokenize_str("a 12345")]
    assert got == pieces


@pytest.mark.parametrize(("pre", "pieces"), [
    ("default", ["It", "'", "s", "ĠHelloWorld"]),  # punctuation split off first
    ("gpt-2", ["It", "'s", "ĠHelloWorld"]),
    ("tekken", ["It", "'s", "ĠHello", "World"]),  # capitals start a word
])
def test_pre_tokenizer_words(pre, pieces):
    got = [piece for piece, _ in pre_tokenizer_for(pre).pre_tokenize_str("It's HelloWorld")]
    assert got == pieces


def test_an_unknown_pre_tokenizer_is_refused_not_guessed(tmp_path):
    """Guessing GPT-2's split gave other tokens than llama.cpp (deepseek-llm, ...)."""
    from tests.gguf import synth
    from veloxquant_mlx.gguf import GGUFError, convert_gguf

    path = synth.write_model(tmp_path / "ds.gguf", synth.Spec("Q8_0", pre="deepseek-llm"))
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre 'deepseek-llm' is not supported"):
        convert_gguf(path, tmp_path / "cache")
    with pytest.raises(ValueError, match="'deepseek-llm' is not supported"):
        pre_tokenizer_for("deepseek-llm")


def test_smollm2_specials_are_single_tokens(smollm2_loaded):
    _, tok = smollm2_loaded
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "Ċ", "Hi", "<|im_end|>"]
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>"


def test_smollm2_round_trip_and_no_bos(smollm2_loaded):
    _, tok = smollm2_loaded
    text = "Hello world! The year 2024 — naïve café.<|endoftext|>"
    ids = tok.encode(text)
    assert ids[0] != 1  # add_bos_token is false for SmolLM2
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("Hello world"))[:2] == ["Hello", "Ġworld"]
    # "smollm" pre-tokenizer: every digit is its own token.
    assert tok.convert_ids_to_tokens(tok.encode("2024")) == ["2", "0", "2", "4"]


def test_smollm2_eos_and_chatml(smollm2_loaded):
    _, tok = smollm2_loaded
    assert tok.eos_token_ids == {2} and tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenize_options_on_a_tokenizer_that_adds_a_bos(synth_tokenizer):
    """/tokenize's add_special and parse_special reach the tokenizer (the BOS is id 0)."""
    from types import SimpleNamespace

    from server.text.prompts import tokenize_prompt

    loaded = SimpleNamespace(tokenizer=synth_tokenizer)
    text = "<|im_start|>hello"
    as_generated = tokenize_prompt(loaded, text)
    assert as_generated[:2] == [0, 1]  # BOS, then the control token itself
    assert tokenize_prompt(loaded, text, add_special=False) == as_generated[1:]
    as_characters = tokenize_prompt(loaded, text, add_special=False, parse_special=False)
    assert 1 not in as_characters and len(as_characters) > len(as_generated) - 1
    assert synth_tokenizer.decode(as_characters) == text
