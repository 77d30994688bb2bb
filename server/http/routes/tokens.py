"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP.

Clients count a prompt's tokens before they send it (to fit
``limits.max_prompt_tokens``, or to budget ``max_tokens``), and map ids back
to text. The ids are exactly those a generation request would run on: the
same code tokenizes both (``Engine.tokenize``). Both servers that have these
routes are answered in their own terms: vLLM's (``count``, ``tokens``,
``token_strs``; ``prompt`` back from ids) and llama.cpp's (``content`` in,
``tokens`` as ``{id, piece}`` with ``with_pieces``; ``content`` back from ids).

Tokenizing a prompt near the body limit takes about a second, so it runs on a
worker thread, never on the event loop; no model work and no pool block is
involved.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from server.http.errors import engine_error
from server.http.routes.call import get_engine
from server.http.routes.chat import built_prompt
from server.http.routes.conversation import messages_fit
from server.http.routes.params import check_model
from server.http.schemas.template_kwargs import checked_template_kwargs
from server.http.schemas.tokens import DetokenizeRequest, TokenizeRequest
from server.http.schemas.tools import tool_plan
from server.refusal import Rejected

router = APIRouter()


@router.post("/tokenize", dependencies=[Depends(messages_fit)])
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """The prompt's ids and their count, and the server's prompt limit beside them.

    A conversation that could never fit ``limits.max_prompt_tokens`` is refused (400)
    before it is rendered (:mod:`server.http.routes.conversation`)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    if body.messages is not None:
        chat = await built_prompt(body.messages, tool_plan(body.tools, body.tool_choice, None),
                                  checked_template_kwargs(body.chat_template_kwargs))
        prompt = replace(chat, generation_prompt=body.add_generation_prompt)
    else:
        prompt = body.text
    ids = await asyncio.to_thread(engine.tokenize, prompt, body.adds_special, body.parse_special)
    if isinstance(ids, Rejected):
        error = engine_error(ids)
        if body.content is not None and ids.param == "prompt":
            # Named as this client sent it.
            error.param = "content"
            error.message = error.message.replace("the prompt", "content", 1)
        raise error
    limit = request.app.state.settings.limits.max_prompt_tokens
    answer = {"count": len(ids), "tokens": ids, "max_prompt_tokens": limit,
              "max_model_len": getattr(engine, "context_length", None)}
    if body.with_pieces:
        pieces = await asyncio.to_thread(engine.token_pieces, ids)
        answer["tokens"] = [{"id": token, "piece": as_piece(raw)}
                            for token, raw in zip(ids, pieces, strict=True)]
    if body.return_token_strs:
        answer["token_strs"] = await asyncio.to_thread(engine.token_strs, ids)
    return JSONResponse(answer)


def as_piece(raw: bytes) -> str | list[int]:
    """A token's bytes as llama.cpp writes a piece: text where they are whole UTF-8,
    else the byte values (the token holds part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """The text the ids decode to (special tokens included, as the vocabulary writes them),
    under vLLM's name (``prompt``) and llama.cpp's (``content``)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    text = await asyncio.to_thread(engine.detokenize, body.tokens)
    if isinstance(text, Rejected):
        raise engine_error(text)
    return JSONResponse({"prompt": text, "content": text})
