"""Completions ``echo``: the prompt as sent and, with ``logprobs``, its tokens' log-probabilities.

Scoring a prompt is a request of the engine's like a generation
(:mod:`server.engine.tasks`): submitted with ``score`` set and
``max_tokens`` 0, queued, admitted against the pool, its KV under its own
owner, its chunks time-sliced with every other prefill, cancelled when the
client leaves. Its answer carries numbers only; the records (token texts) are
built here on a worker thread. An echo without ``logprobs`` needs no model:
it is only tokenized (on a worker thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from server.http.errors import InvalidRequestError, engine_error
from server.http.routes.call import GenerationCall
from server.http.routes.fanout import Fanout
from server.protocol import SamplingParams, TokenLogprob, TopLogprob
from server.refusal import Rejected


@dataclass(slots=True)
class Echo:
    """What an echoed prompt adds to an answer.

    Attributes:
        ids: The prompt's token ids.
        tokens: Each token's text (``decode([id])``, as generated tokens report it).
        text: The prompt as echoed: the string sent, or the ids decoded.
        logprobs: Records of ``ids[1:]`` (empty when no log-probabilities were asked).
    """

    ids: list[int]
    tokens: list[str]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


def echo_of(decode: Callable[[list[int]], str], prompt: str | list[int],
            ids: list[int], scores: Any = None) -> Echo:
    """The echo of ``prompt`` (tokenized to ``ids``), with the records of its scores (a
    scoring request's result: ``chosen``, ``top_ids``, ``top_vals``, ``top_n``).

    Decodes every token and alternative, so it blocks: call it from a worker thread.
    Each id is decoded once (alternatives repeat across positions), which keeps the
    thread's hold on the GIL short beside the engine thread's.
    """
    pieces: dict[int, str] = {}

    def piece(token: int) -> str:
        text = pieces.get(token)
        if text is None:
            text = pieces[token] = decode([token])
        return text

    tokens = [piece(i) for i in ids]
    text = prompt if isinstance(prompt, str) else decode(ids)
    echo = Echo(ids, tokens, text)
    if scores is None:
        return echo
    for j, value in enumerate(scores.chosen):
        pairs = (sorted(zip(scores.top_ids[j], scores.top_vals[j], strict=True),
                        key=lambda p: -p[1]) if scores.top_n else [])
        top = tuple(TopLogprob(piece(int(i)), v, int(i)) for i, v in pairs)
        echo.logprobs.append(TokenLogprob(tokens[j + 1], value, ids[j + 1], top))
    return echo


async def echo_prompts(http_request: Request, engine: Any, prompts: list[str | list[int]],
                       top_n: int | None, request_id: str) -> list[Echo]:
    """One echo per prompt, scored by the model when ``top_n`` is not None.

    Args:
        http_request: For disconnect polling.
        engine: The engine.
        prompts: Prompt texts or token ids.
        top_n: Alternatives per token (``logprobs``), or None: no scoring, only
            tokenizing (the echoed text and the prompt's token count).
        request_id: The answer's id; a scoring request of a batch adds its place.

    Raises:
        APIError: A prompt is refused (empty, too long, bad ids, no room) or scoring failed.
        ClientGone: The client left.
    """
    if top_n is None:
        return [await _tokenized(engine, prompt, _param(prompts, p))
                for p, prompt in enumerate(prompts)]
    if engine.settings.distributed.ranks > 1:  # the scoring pass runs on rank 0 alone
        raise InvalidRequestError("echo with logprobs is not available while the model is "
                                  "split over ranks (distributed.ranks > 1)", param="echo")
    calls = [GenerationCall(http_request, engine, prompt, SamplingParams(max_tokens=0),
                            request_id if len(prompts) == 1 else f"{request_id}-echo-{p}",
                            _param(prompts, p), score=top_n)
             for p, prompt in enumerate(prompts)]
    fanout = Fanout(calls)
    await fanout.start()
    outs = await fanout.collect()
    decode = engine.loaded.tokenizer.decode
    return [await asyncio.to_thread(echo_of, decode, prompt, out.finished.result.ids,
                                    out.finished.result)
            for prompt, out in zip(prompts, outs, strict=True)]


async def _tokenized(engine: Any, prompt: str | list[int], param: str) -> Echo:
    ids = await asyncio.to_thread(engine.echo_ids, prompt)
    if isinstance(ids, Rejected):
        error = engine_error(ids)
        if error.param == "prompt" and param != "prompt":  # which one of a batch
            error.param, error.message = param, f"{param}: {error.message}"
        raise error
    return await asyncio.to_thread(echo_of, engine.loaded.tokenizer.decode, prompt, ids)


def _param(prompts: list[Any], p: int) -> str:
    return "prompt" if len(prompts) == 1 else f"prompt[{p}]"
