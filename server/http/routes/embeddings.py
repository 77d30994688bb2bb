"""``POST /v1/embeddings``: each input's final hidden states, pooled and normalized.

Every input is an engine request of its own (``GenerationRequest.embed``;
:mod:`server.engine.tasks`): queued, admitted against the pool, prefilled
in chunks beside running generations, its blocks back as soon as it ends.
A batch is sent in waves of at most ``batch.max_batch_size`` inputs, so a
large one (RAG indexers send hundreds) waits its turn instead of overflowing
the queue bound, and a refusal cancels what it started.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.http.errors import CLIENT_CLOSED, InvalidRequestError
from server.http.routes.call import ClientGone, GenerationCall, get_engine
from server.http.routes.fanout import Fanout
from server.http.routes.params import check_model, new_id
from server.http.schemas.embeddings import EmbeddingRequest
from server.http.unknown_fields import unknown_fields_of
from server.protocol import SamplingParams

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs


@router.post("/v1/embeddings", dependencies=[
    Depends(unknown_fields_of(EmbeddingRequest, "/v1/embeddings"))])
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Embed each input (OpenAI's shape: ``data[i].embedding``, floats or base64)."""
    engine = get_engine(request)
    check_model(body.model, engine)
    inputs = _inputs(body.input)
    _check(engine, body)
    settings = request.app.state.settings
    pooling, rid = settings.model.embedding_pooling, new_id("embd", request)
    wave = max(settings.batch.max_batch_size, 1)
    finished: list[Any] = []
    try:
        for start in range(0, len(inputs), wave):
            calls = [GenerationCall(request, engine, prompt, SamplingParams(max_tokens=0),
                                    f"{rid}-{i}", _param(inputs, i), embed=pooling)
                     for i, prompt in enumerate(inputs[start:start + wave], start)]
            fanout = Fanout(calls)
            await fanout.start()
            finished += [out.finished for out in await fanout.collect()]
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    data = [{"object": "embedding", "index": i,
             "embedding": encoded(end.result.vector, body.encoding_format)}
            for i, end in enumerate(finished)]
    tokens = sum(end.usage.prompt_tokens for end in finished)
    return JSONResponse({"object": "list", "data": data, "model": engine.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _inputs(raw: Any) -> list[str | list[int]]:
    """The inputs as prompts: a string or an id list is one input."""
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        inputs = [raw]
    else:
        inputs = list(raw)
    if not inputs:
        raise InvalidRequestError("input must not be empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"input has {len(inputs)} items, more than {MAX_INPUTS}; "
                                  "send several requests", param="input")
    for i, one in enumerate(inputs):
        if not one:
            raise InvalidRequestError(f"{_param(inputs, i)} must not be empty", param="input",
                                      code="empty_prompt")
    return inputs


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The embedding as OpenAI's ``encoding_format`` asks: floats, or base64 of
    little-endian float32 (what the ``openai`` client decodes with numpy)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _check(engine: Any, body: EmbeddingRequest) -> None:
    if not engine.can_embed:
        raise InvalidRequestError("the served model exposes no backbone to take hidden "
                                  "states from, so it gives no embeddings", param="model")
    if engine.settings.distributed.ranks > 1:
        raise InvalidRequestError("embeddings are not available while the model is split "
                                  "over ranks (distributed.ranks > 1)", param="input")
    width = engine.embedding_size
    if body.dimensions is not None and body.dimensions != width:
        raise InvalidRequestError(f"dimensions={body.dimensions} is not supported: this "
                                  f"model's embeddings have {width} dimensions and are not "
                                  "trained to be shortened; leave dimensions out",
                                  param="dimensions", code="unsupported_parameter")


def _param(inputs: list[Any], i: int) -> str:
    return "input" if len(inputs) == 1 else f"input[{i}]"
