"""SentencePiece (``tokenizer.ggml.model == "llama"``) vocabularies as a ``tokenizers`` BPE.

A GGUF file keeps a SentencePiece vocabulary as its pieces, one score each
and a type each, not as merges. llama.cpp tokenizes it by repeatedly joining
the adjacent pair of symbols whose joined text is a piece with the highest
score; text no piece covers falls back to ``<0xNN>`` byte pieces. That is BPE
with one merge per way of splitting a piece into two pieces, ranked by the
joined piece's score, which is how this module writes it:

    normalizer  " " -> "▁", and a "▁" in front (``add_space_prefix``, default on)
    model       BPE, merges ranked by score, byte fallback, unknown pieces fused
    decoder     "▁" -> " ", bytes joined, the first space stripped

That decoder is the one mlx-lm recognises as SentencePiece's, so streamed text
is detokenized the SentencePiece way.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

from .config import meta
from .errors import GGUFError
from .header import GGUFHeader

SPACE = "\u2581"  # "▁", SentencePiece's visible space
# llama.cpp token types (tokenizer.ggml.token_type) that text can merge into.
TOKEN_NORMAL, TOKEN_USER_DEFINED = 1, 4


def spm_merges(pieces: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces, highest joined score first.

    Ties keep the joined piece's id order, then the left part's id: the order
    is total, so the same vocabulary always gives the same merges. Control,
    unknown, byte and unused pieces are never merge results: text must not
    turn into them.
    """
    ids: dict[str, int] = {}
    for index, piece in enumerate(pieces):
        ids.setdefault(piece, index)
    ranked = []
    for index, piece in enumerate(pieces):
        if types[index] not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or ids[piece] != index:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[index], index, ids[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(header: GGUFHeader, pieces: list[str], types: list[int]) -> Tokenizer:
    """The tokenizer of a SentencePiece vocabulary, without added tokens or post-processing.

    Raises:
        GGUFError: The scores are missing or not one per piece, or there is no
            unknown piece for text outside the vocabulary.
    """
    scores = [float(s) for s in meta(header, "tokenizer.ggml.scores")]
    if len(scores) != len(pieces):
        raise GGUFError(header.path, f"tokenizer.ggml.scores has {len(scores)} values for "
                                     f"{len(pieces)} tokens")
    unk = meta(header, "tokenizer.ggml.unknown_token_id", None)
    if unk is None or not 0 <= int(unk) < len(pieces):
        raise GGUFError(header.path, "SentencePiece vocabulary without a valid "
                                     "tokenizer.ggml.unknown_token_id")
    vocab: dict[str, int] = {}
    for index, piece in enumerate(pieces):
        vocab.setdefault(piece, index)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(pieces, scores, types),
                                     unk_token=pieces[int(unk)], fuse_unk=True,
                                     byte_fallback=True))
    prefix = bool(meta(header, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    parts = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(parts)
    return tokenizer
