"""Turning a submitted request into prompt ids (engine thread; no MLX work).

Failures become :class:`RequestRejected` carrying the event the client gets.
"""

from __future__ import annotations

from dataclasses import replace

from server.engine.chat_render import render_ids
from server.engine.protocol import ChatPrompt, Reason, Rejected, SamplingParams
from server.model_loader import LoadedModel


class RequestRejected(Exception):
    """Raised inside intake to turn a request away before it queues."""

    def __init__(self, event: Rejected, prompt_tokens: int | None = None) -> None:
        super().__init__(event.message)
        self.event = event
        self.prompt_tokens = prompt_tokens  # the prompt's size, when it was tokenized


def no_room(prompt: str | list[int] | ChatPrompt, n_prompt: int, where: str,
            fix: str = "") -> Rejected:
    """The 400 for a prompt that leaves no room for one generated token ``where`` (the
    model's context, the KV pool), naming the field to shorten; ``fix`` adds other ways."""
    chat = isinstance(prompt, ChatPrompt)
    field = "messages" if chat else "prompt"
    return Rejected(Reason.TOO_LARGE,
                    f"{'the rendered messages have' if chat else 'the prompt has'} {n_prompt} "
                    f"tokens, which leave no room for a generated token in {where}; shorten "
                    f"the {field}{fix}", field)


def no_room_in_pool(prompt: str | list[int] | ChatPrompt, n_prompt: int,
                    pool_tokens: int) -> Rejected:
    """:func:`no_room` for a prompt that alone fills what the KV pool holds for one request
    (``pool_tokens``): no ``max_tokens`` helps, so none is named."""
    return no_room(prompt, n_prompt, f"the KV pool (at most {pool_tokens} tokens a request)",
                   ", or raise pool.n_blocks (or pool.max_blocks with "
                   "pool.grow_on_exhaustion)")


def vocab_size(loaded: LoadedModel) -> int | None:
    """The model's vocabulary size, when its config says it (None otherwise)."""
    return getattr(getattr(loaded.model, "args", None), "vocab_size", None)


def out_of_vocab(loaded: LoadedModel, ids: list[int]) -> int | None:
    """The first of ``ids`` outside the model's vocabulary, or None (also when its size is
    unknown)."""
    vocab = vocab_size(loaded)
    return None if vocab is None else next((t for t in ids if not 0 <= t < vocab), None)


def tokenize_prompt(loaded: LoadedModel, prompt: str | list[int] | ChatPrompt,
                    add_special: bool = True, parse_special: bool = True) -> list[int]:
    """Prompt ids for text, token ids or chat messages (rendered with the chat template).

    ``add_special`` and ``parse_special`` apply to text only (``/tokenize`` takes
    them; a generation always runs on the defaults): the tokenizer's own special
    tokens (a BOS) put in front, and special-token text such as ``<|im_start|>``
    read as that token rather than as its characters.

    Raises:
        RequestRejected: The prompt cannot be tokenized or has ids out of the vocabulary.
    """
    tokenizer = loaded.tokenizer
    try:
        if isinstance(prompt, ChatPrompt):
            return render_ids(tokenizer, prompt)
        if isinstance(prompt, str):
            utf8(prompt)  # a lone surrogate: said plainly, not in the tokenizer's words
            options = {} if parse_special else {"split_special_tokens": True}
            if not add_special:
                options["add_special_tokens"] = False
            return list(tokenizer.encode(prompt, **options))
        if out_of_vocab(loaded, prompt) is not None:
            raise ValueError(f"prompt token ids must be in 0..{vocab_size(loaded) - 1}")
        return list(prompt)
    except RequestRejected:
        raise
    except Exception as exc:
        param = "messages" if isinstance(prompt, ChatPrompt) else "prompt"
        raise RequestRejected(Rejected(Reason.INVALID_PROMPT,
                                       f"cannot tokenize the {param}: {exc}", param)) from None


def ban_end_tokens(loaded: LoadedModel, params: SamplingParams) -> SamplingParams:
    """``params`` with the model's end tokens banned when the client asked ``ignore_eos``.

    Raises:
        RequestRejected: With a grammar (``response_format``, a forced tool call),
            whose only way to finish is an end token.
    """
    if not params.ignore_eos:
        return params
    if params.constraint is not None:
        raise RequestRejected(Rejected(
            Reason.INVALID_VALUE, "ignore_eos cannot be combined with a JSON response_format "
            "or a forced tool call: the grammar ends the answer with an end token",
            "ignore_eos"))
    return replace(params, banned_tokens=tuple(sorted(loaded.tokenizer.eos_token_ids)))


def check_token_params(loaded: LoadedModel, params: SamplingParams) -> None:
    """Reject ``logit_bias`` token ids outside the model's vocabulary.

    They index the logits directly: an id past the end makes MLX read and
    write out of bounds (a crash of the whole process), and a negative one
    would silently bias a token counted from the end.

    Raises:
        RequestRejected: With the first offending id.
    """
    vocab = vocab_size(loaded)
    if vocab is None:
        return
    for token, _ in params.logit_bias:
        if not 0 <= token < vocab:
            raise RequestRejected(Rejected(
                Reason.INVALID_VALUE, f"logit_bias token id {token} is not in this model's "
                f"vocabulary (0..{vocab - 1})", "logit_bias"))


def utf8(prompt: str) -> bytes:
    """The prompt's UTF-8 bytes.

    JSON can carry a lone UTF-16 surrogate (``"\\ud800"``), which Python keeps in the
    string but no UTF-8 encoder (nor the tokenizer) accepts.

    Raises:
        RequestRejected: The prompt holds such a surrogate (400 ``invalid_prompt``).
    """
    try:
        return prompt.encode()
    except UnicodeEncodeError as exc:
        raise RequestRejected(Rejected(
            Reason.INVALID_PROMPT, f"the prompt is not valid Unicode: a lone surrogate "
            f"(U+{ord(prompt[exc.start]):04X}) at character {exc.start}", "prompt")) from None
