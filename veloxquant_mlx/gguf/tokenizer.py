"""Rebuild a Hugging Face ``tokenizers`` tokenizer from GGUF vocabulary metadata.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: Llama 3,
Qwen2/3, SmolLM, StarCoder, ...) are rebuilt from their merges here;
SentencePiece ones (``"llama"``: Llama 2, Mistral, TinyLlama, ...) from their
scores by :mod:`.spm`. Added tokens, BOS/EOS and the config files are common
to both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .config import meta
from .errors import GGUFError
from .header import GGUFHeader
from .spm import build_spm_tokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 2, 3, 4

# The split patterns of llama.cpp's BPE pre-tokenizers (llama-vocab.cpp), for the
# names it gives them in ``tokenizer.ggml.pre``. Several patterns in a row split
# the pieces of the one before, as a Sequence of Splits does.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
_TEKKEN_RE = (  # Mistral Nemo: a word may start with capitals, then lower case
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's BPE pre-tokenizers: its split patterns, in order.

    ``ignore_merges``: a whole word found in the vocabulary is taken as it is
    before any merge (llama.cpp does so for Llama 3 and Tekken).
    """

    patterns: tuple[str, ...]
    ignore_merges: bool = False


_LLAMA3 = PreTokenizer((_LLAMA3_RE,), ignore_merges=True)
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2_RE))
_GPT2 = PreTokenizer((_GPT2_RE,))
# llama.cpp's "default" (also what it uses, with a loud warning, when a file names none).
_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), _LLAMA3),
    **dict.fromkeys(("smaug-bpe", "dbrx"), PreTokenizer((_LLAMA3_RE,))),
    **dict.fromkeys(("qwen2", "qwen", "deepseek-r1-qwen", "kormo"), PreTokenizer((_QWEN2_RE,))),
    "tekken": PreTokenizer((_TEKKEN_RE,), ignore_merges=True),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _DIGITS_THEN_GPT2),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion"), _GPT2),
    "default": _DEFAULT,
}


def pre_tokenizer_spec(pre: str | None) -> PreTokenizer | None:
    """The pre-tokenizer a ``tokenizer.ggml.pre`` name stands for; None if unknown.

    A file without the key gets llama.cpp's ``default``, as llama.cpp gives it.
    """
    return _DEFAULT if pre is None else PRE_TOKENIZERS.get(pre)


def pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer for a ``tokenizer.ggml.pre`` name.

    Raises:
        ValueError: llama.cpp names it but we do not reproduce it (or nobody
            does): tokens would differ from what the model was trained on.
    """
    spec = pre_tokenizer_spec(pre)
    if spec is None:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))})")
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in spec.patterns]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


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
        spec = pre_tokenizer_spec(pre)
        try:
            tokenizer = Tokenizer(_bpe_model(header, tokens, spec is not None and
                                             spec.ignore_merges))
            tokenizer.pre_tokenizer = pre_tokenizer_for(pre)
        except ValueError as exc:
            raise GGUFError(header.path, str(exc)) from exc
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
