"""How a refusal reads to a client: the engine says what and its numbers, this words it.

Each :class:`~server.refusal.Why` has one sentence here, built from the
refusal's figures; the sentence says what was wrong and how to fix it
(which field to lower, to what, or which setting to raise). This is the only
place that words a refusal, so the messages stay consistent and a change of
wording touches no engine code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from server.refusal import PoolMisfit, Rejected, Why

_RAISE_POOL = "raise pool.n_blocks (or pool.max_blocks with pool.grow_on_exhaustion)"


def describe(event: Rejected) -> str:
    """The message a client reads for ``event``."""
    return _WORDING[event.why](event.figures, event.param or "")


def _context(f: Mapping[str, Any]) -> str:
    """The context bound, naming where it comes from."""
    if f["context_configured"]:
        return f"the served context of {f['context']} tokens (limits.max_context_tokens)"
    return f"the model's context of {f['context']} tokens (the model's max_position_embeddings)"


def _has(param: str) -> str:
    """The prompt as a refusal names it: chat messages are rendered before they count."""
    return "the rendered messages have" if param == "messages" else "the prompt has"


def _misfit(m: PoolMisfit, field: str) -> str:
    """The pool's arithmetic that a request's reservation never fits."""
    fix = (f"lower {field} or shorten the prompt to fit {m.most_tokens} tokens in total, or "
           if m.most_tokens > 0 else
           "the pool holds no request now (shrunk by /admin/shrink?); ")
    both = " x 2 (k and v)" if m.shared_stream else ""
    return (f"prompt plus {field} ({m.n_tokens} tokens) needs {m.blocks} KV blocks on stream "
            f"{m.stream!r} ({m.n_layers} layers x ceil({m.n_tokens}/{m.block_size}){both}), "
            f"but the pool holds at most {m.have} there; {fix}{_RAISE_POOL}")


def _over_context(f: Mapping[str, Any], param: str) -> str:
    tokens, wanted, fits = f["tokens"], f["max_tokens"], f["fits"]
    pool = ("" if fits == f["context"] - tokens
            else f" (the KV pool holds at most {f['pool']} tokens a request)")
    return (f"the prompt's {tokens} tokens plus {param}={wanted} come to {tokens + wanted} "
            f"tokens, over {_context(f)}; lower {param} to at most {fits}{pool}, or shorten "
            f"the {f['prompt_field']}")


def _out_of_vocab(f: Mapping[str, Any], param: str) -> str:
    what = "logit_bias token id" if param == "logit_bias" else "token id"
    return f"{what} {f['token']} is not in this model's vocabulary (0..{f['vocab'] - 1})"


_Wording = Callable[[Mapping[str, Any], str], str]

_WORDING: dict[Why, _Wording] = {
    Why.EMPTY_PROMPT: lambda f, p: "the prompt is empty (0 tokens)",
    Why.UNTOKENIZABLE: lambda f, p: f"cannot tokenize the {p}: {f['error']}",
    Why.LONE_SURROGATE: lambda f, p: (
        f"the prompt is not valid Unicode: a lone surrogate (U+{f['codepoint']:04X}) at "
        f"character {f['index']}"),
    Why.OUT_OF_VOCAB: _out_of_vocab,
    Why.IGNORE_EOS_WITH_GRAMMAR: lambda f, p: (
        "ignore_eos cannot be combined with a JSON response_format or a forced tool call: "
        "the grammar ends the answer with an end token"),
    Why.PROMPT_BYTES_OVER_LIMIT: lambda f, p: (
        f"prompt has {f['bytes']} bytes, so more than limits.max_prompt_tokens={f['limit']} "
        "tokens; shorten the prompt"),
    Why.PROMPT_OVER_LIMIT: lambda f, p: (
        f"{'the rendered messages have' if p == 'messages' else 'prompt has'} {f['tokens']} "
        f"tokens, more than limits.max_prompt_tokens={f['limit']}; shorten the {p}"),
    Why.PROMPT_OVER_CONTEXT: lambda f, p: (
        f"prompt has {f['tokens']} tokens, more than {_context(f)}; shorten the {p}"),
    Why.CONVERSATION_MESSAGES: lambda f, p: (
        f"the conversation has {f['messages']} messages, more than "
        f"limits.max_prompt_tokens={f['limit']} tokens can hold: every message takes at "
        f"least one token of the chat template; shorten the {p}"),
    Why.CONVERSATION_CHARS: lambda f, p: (
        f"the conversation has {f['chars']} characters of message text, more than "
        f"limits.max_prompt_tokens={f['limit']} tokens can hold (one token covers at most "
        f"{f['per_token']} characters); shorten the {p}"),
    Why.NO_ROOM_IN_CONTEXT: lambda f, p: (
        f"{_has(p)} {f['tokens']} tokens, which leave no room for a generated token in "
        f"{_context(f)}; shorten the {p}"),
    Why.NO_ROOM_IN_POOL: lambda f, p: (
        f"{_has(p)} {f['tokens']} tokens, which leave no room for a generated token in the "
        f"KV pool (at most {f['pool_tokens']} tokens a request); shorten the {p}, or "
        f"{_RAISE_POOL}"),
    Why.OVER_CONTEXT: _over_context,
    Why.NEVER_FITS_POOL: lambda f, p: (
        f"{_misfit(f['misfit'], p)}; with this prompt, {p} can be at most {f['room']}"),
    Why.GROUP_NEVER_FITS: lambda f, p: (
        f"the n={f['size']} choices of a prompt start together or not at all, and together "
        f"{_misfit(f['misfit'], f['field'])}; or lower n"),
    Why.PREPARER_BUSY: lambda f, p: (
        f"server busy: {f['pending']} prompts are being tokenized; retry later"),
    Why.QUEUE_FULL: lambda f, p: (
        f"server busy: {f['waiting']} requests already wait for a batch slot or KV capacity "
        f"(limits.max_queue={f['max_queue']}); retry later"),
    Why.QUEUE_TIMEOUT: lambda f, p: (
        f"no KV capacity within limits.queue_timeout_s={f['timeout_s']}s; retry later"),
    Why.CANCELLED_WAITING: lambda f, p: "the request was cancelled",
    Why.SHUTTING_DOWN: lambda f, p: "the server is shutting down",
    Why.MODEL_NOT_LOADED: lambda f, p: "the model is not loaded",
    Why.ENGINE_STOPPED: lambda f, p: (
        f"the engine stopped after an error ({f['error']}); restart the server"),
    Why.PREPARE_FAILED: lambda f, p: f"preparing the prompt failed: {f['error']}",
}
