"""A sound "too long" verdict on a text prompt from its byte count alone.

Tokenizing a 1 MiB prompt takes about a second; refusing it for being over
``limits.max_prompt_tokens`` should not. A token stands for at most ``B``
bytes of input, ``B`` the longest entry of the vocabulary (added tokens
included) in UTF-8. If every input byte ends up inside some token, then::

    tokens >= bytes / B        so   bytes > max_prompt_tokens * B  proves "too long"

The premise only holds for tokenizers that cannot drop or shrink input, so
the bound is derived only when the tokenizer's own description shows that:

- no normalizer, or only ones that never shorten text (``Prepend``, a
  ``Replace`` whose replacement is not shorter than its pattern);
- pre-tokenizers that keep every byte (``ByteLevel``, ``Metaspace``,
  ``Digits``, ``Split`` that does not remove its matches);
- every byte has a token: a ``ByteLevel`` pre-tokenizer or a BPE/Unigram
  model with ``byte_fallback`` (an unknown-token fallback may swallow a
  whole word, so it does not count);
- no added token strips the whitespace around it (``lstrip``/``rstrip``
  would let one token absorb unboundedly many spaces).

Otherwise :func:`max_bytes_per_token` returns None and every prompt is
tokenized (off the engine thread) before its length is judged. UTF-8 byte
lengths of vocabulary strings over-count what byte-level tokens cover (their
printable stand-ins take 1-2 bytes for 1 input byte), which errs on the
safe side.
"""

from __future__ import annotations

import json
from typing import Any

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
