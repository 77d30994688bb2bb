"""Raw-HTTP answers checked against the official ``openai`` package's own pydantic types."""

from __future__ import annotations

import json
from typing import Any

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
PROMPT = "Once upon a time"


def sse_chunks(resp: httpx.Response) -> list[dict[str, Any]]:
    """The JSON frames of an SSE answer; it must end with exactly one ``[DONE]``."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    return [json.loads(frame) for frame in frames[:-1]]


def without_echo_nulls(body: dict[str, Any]) -> dict[str, Any]:
    """A copy with each echoed prompt's leading ``null`` log-probability dropped.

    OpenAI answers the unscored first prompt token with ``null`` (as the issue
    asks), which the client's ``List[float]`` type does not foresee; the rest
    of the answer is checked against the type as is.
    """
    body = json.loads(json.dumps(body))
    for choice in body.get("choices", []):
        lp = choice.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[key] = lp[key][1:]
    return body


def completion(resp: httpx.Response) -> Completion:
    """A 200 completions answer, validated as ``openai.types.Completion``."""
    assert resp.status_code == 200, resp.text
    return Completion.model_validate(without_echo_nulls(resp.json()))


def chat(resp: httpx.Response) -> ChatCompletion:
    """A 200 chat answer, validated as ``openai.types.chat.ChatCompletion``."""
    assert resp.status_code == 200, resp.text
    return ChatCompletion.model_validate(resp.json())


def completion_stream(resp: httpx.Response) -> list[Completion]:
    """Every chunk of a completions stream, each validated as ``Completion``.

    Mid-stream chunks carry ``"finish_reason": null``, as OpenAI streams them;
    the client's ``Completion`` (written for whole answers) wants a value, so
    it is checked to be null here and validated as the type with ``None`` put
    back afterwards.
    """
    out = []
    for chunk in sse_chunks(resp):
        chunk = without_echo_nulls(chunk)
        pending = {c["index"] for c in chunk["choices"] if c["finish_reason"] is None}
        for c in chunk["choices"]:
            if c["index"] in pending:
                c["finish_reason"] = "length"
        parsed = Completion.model_validate(chunk)
        for c in parsed.choices:
            if c.index in pending:
                c.finish_reason = None
        out.append(parsed)
    return out


def chat_stream(resp: httpx.Response) -> list[ChatCompletionChunk]:
    """Every chunk of a chat stream, each validated as ``ChatCompletionChunk``."""
    return [ChatCompletionChunk.model_validate(c) for c in sse_chunks(resp)]


def error_of(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    """The OpenAI-shaped error of a refused request."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]
