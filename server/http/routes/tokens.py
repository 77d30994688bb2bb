"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP.

Clients count a prompt's tokens before they send it (to fit
``limits.max_prompt_tokens``, or to budget ``max_tokens``), and map ids back
to text. The ids are exactly those a generation request would run on: the
same code tokenizes both (``Engine.tokenize``). The
shape is vLLM's (``count``, ``tokens``; ``prompt`` back from ids); llama.cpp's
server has the same two routes.

Tokenizing a prompt near the body limit takes about a second, so it runs on a
worker thread, never on the event loop; no model work and no pool block is
involved.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.engine.protocol import Rejected
from server.http.errors import engine_error
from server.http.routes.call import get_engine
from server.http.routes.chat import chat_prompt
from server.http.routes.params import check_model
from server.http.schemas.tokens import DetokenizeRequest, TokenizeRequest
from server.http.schemas.tools import tool_plan

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """The prompt's ids and their count, and the server's prompt limit beside them."""
    engine = get_engine(request)
    check_model(body.model, engine)
    if body.messages is not None:
        prompt = chat_prompt(body.messages, tool_plan(body.tools, body.tool_choice, None))
    else:
        prompt = body.prompt
    ids = await asyncio.to_thread(engine.tokenize, prompt)
    if isinstance(ids, Rejected):
        raise engine_error(ids)
    limit = request.app.state.settings.limits.max_prompt_tokens
    return JSONResponse({"count": len(ids), "tokens": ids, "max_prompt_tokens": limit,
                         "max_model_len": getattr(engine, "context_length", None)})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """The text the ids decode to (special tokens included, as the vocabulary writes them)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    text = await asyncio.to_thread(engine.detokenize, body.tokens)
    if isinstance(text, Rejected):
        raise engine_error(text)
    return JSONResponse({"prompt": text})
