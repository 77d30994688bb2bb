"""Rebuild a Hugging Face ``tokenizers`` tokenizer from GGUF vocabulary metadata.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: Llama 3,
Qwen2/3, SmolLM, StarCoder, ...) are rebuilt from their merges here;
SentencePiece ones (``"llama"``: Llama 2, Mistral, TinyLlama, ...) from their
scores by :mod:`.spm`. Added tokens, BOS/EOS and the config files are common
to both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .config import meta
from .errors import GGUFError
from .header import GGUFHeader
from .spm import build_spm_tokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 2, 3, 4

# Split patterns of the pre-tokenizers that differ from GPT-2's. llama-bpe
# (Llama 3) groups digits by up to three; qwen2 splits every digit.
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    """Regex split, then byte-level mapping without GPT-2's own regex."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` name.

    Unknown names fall back to GPT-2's regex: it is what llama.cpp itself uses
    for "default", and for most BPE vocabularies it differs only in how runs
    of digits or newlines are grouped, which changes token boundaries but never
    the decoded text.
    """
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3"):
        return _split_then_bytes(_LLAMA3_RE)
    if pre in ("qwen2", "qwen"):
        return _split_then_bytes(_QWEN2_RE)
    if pre in ("smollm", "starcoder", "refact"):
        # Every digit on its own, then GPT-2's regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _token_id(header: GGUFHeader, kind: str, n_vocab: int) -> int | None:
    """The id stored under ``tokenizer.ggml.{kind}_token_id``, range-checked."""
    value = header.metadata.get(f"tokenizer.ggml.{kind}_token_id")
    if value is None:
        return None
    if not 0 <= int(value) < n_vocab:
        raise GGUFError(header.path, f"{kind} token id {value} is outside the vocabulary")
    return int(value)


def _bpe_model(header: GGUFHeader, tokens: list[str], ignore_merges: bool) -> models.BPE:
    """The BPE model from the token list and merges."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # first id wins if a vocabulary repeats a token
    merges = []
    for merge in meta(header, "tokenizer.ggml.merges"):
        # Split at the first space after position 0, as llama.cpp does, so a
        # token that is itself a space cannot break the pair apart wrongly.
        cut = merge.find(" ", 1)
        if cut < 0:
            raise GGUFError(header.path, f"malformed BPE merge {merge!r}")
        merges.append((merge[:cut], merge[cut + 1 :]))
    return models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[AddedToken], list[AddedToken]]:
    """(special, plain) added tokens: control ones special, user-defined plain.

    llama.cpp's converter marks a Hugging Face added token CONTROL when it was
    special and USER_DEFINED when it was not, so this restores the original
    split: both are matched whole, but only special ones are skipped when
    decoding with ``skip_special_tokens``.
    """
    special, plain = [], []
    for token, kind in zip(tokens, types, strict=False):
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    return special, plain


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool,
    byte_level: bool,
) -> processors.PostProcessor | None:
    """Adds BOS/EOS on encode when the GGUF asks for it."""
    first = [(tokens[bos], bos)] if add_bos and bos is not None else []
    last = [(tokens[eos], eos)] if add_eos and eos is not None else []
    if not first and not last:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    single = " ".join([*(t for t, _ in first), "$A:0", *(t for t, _ in last)])
    pair = " ".join([single, *(f"{t}:1" for t, _ in first), "$B:1", *(f"{t}:1" for t, _ in last)])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=first + last)


def build_tokenizer(header: GGUFHeader) -> Tokenizer:
    """The tokenizer described by the file's metadata (byte-level BPE or SentencePiece)."""
    tokens = list(meta(header, "tokenizer.ggml.tokens"))
    types = list(meta(header, "tokenizer.ggml.token_type", [1] * len(tokens)))
    byte_level = meta(header, "tokenizer.ggml.model") != "llama"
    if byte_level:
        pre = meta(header, "tokenizer.ggml.pre", None)
        # llama.cpp takes a whole word straight from the vocabulary before merging
        # for Llama 3; HF expresses the same with ignore_merges.
        tokenizer = Tokenizer(_bpe_model(header, tokens, ignore_merges=pre == "llama-bpe"))
        tokenizer.pre_tokenizer = pre_tokenizer_for(pre)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        tokenizer = build_spm_tokenizer(header, tokens, types)
    special, plain = _added_tokens(tokens, types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)  # add_special_tokens would force special=True
    post = _post_processor(
        tokens,
        _token_id(header, "bos", len(tokens)),
        _token_id(header, "eos", len(tokens)),
        bool(meta(header, "tokenizer.ggml.add_bos_token", False)),
        bool(meta(header, "tokenizer.ggml.add_eos_token", False)),
        byte_level,
    )
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer


def _special_tokens(header: GGUFHeader, tokens: list[str]) -> dict[str, str]:
    """bos/eos/unk/pad token strings by their metadata ids."""
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    found = {}
    for hf_name, gguf_name in names.items():
        token_id = _token_id(header, gguf_name, len(tokens))
        if token_id is not None:
            found[f"{hf_name}_token"] = tokens[token_id]
    return found


def _eos_ids(header: GGUFHeader, n_vocab: int) -> list[int]:
    """EOS plus end-of-turn/message ids (Llama 3 chats stop on <|eot_id|>)."""
    ids = [_token_id(header, kind, n_vocab) for kind in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def write_tokenizer_files(header: GGUFHeader, folder: Path) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json into ``folder``.

    Returns:
        The generation config (its ``eos_token_id`` also goes into config.json).
    """
    tokens = list(meta(header, "tokenizer.ggml.tokens"))
    build_tokenizer(header).save(str(folder / "tokenizer.json"))
    specials = _special_tokens(header, tokens)
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": bool(meta(header, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta(header, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta(header, "{arch}.context_length", 4096)),
    }
    if (template := meta(header, "tokenizer.chat_template", None)) is not None:
        tok_config["chat_template"] = template
    gen_config: dict[str, Any] = {}
    if (bos := _token_id(header, "bos", len(tokens))) is not None:
        gen_config["bos_token_id"] = bos
    if eos_ids := _eos_ids(header, len(tokens)):
        gen_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    for name, content in (
        ("tokenizer_config.json", tok_config),
        ("special_tokens_map.json", specials),
        ("generation_config.json", gen_config),
    ):
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return gen_config
