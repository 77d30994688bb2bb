"""Every field of OpenAI's completion and chat requests is honoured or refused, never ignored.

The field lists come from the installed ``openai`` package's own request types; the tables
below say what this server does with each one:

- ``honoured``: accepted, and the check sees its effect;
- ``noop``: accepted and without effect by definition (platform metadata, storage, cache
  and billing hints): the answer equals the one without it;
- ``refused``: a 400 whose ``param`` names the field.

A new ``openai`` release with a new field fails ``test_tables_cover_every_field`` until the
field is given a handling here (and in the server). A field in none of the lists is ignored by
default (tests/http/test_dropin_fields.py); with ``server.unknown_fields = "reject"`` it is a
400 naming it, checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest

from tests.support.openai_shapes import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    PROMPT,
    chat,
    chat_stream,
    completion,
    completion_stream,
    error_of,
)
from tests.support.servers import LiveServer, run_server

NO_EOS = {"1": -100, "3": -100}
# (answer, baseline answer, send) -> the effect is seen; send(changes) posts the same
# request with some fields changed, for checks that need a second answer.
Check = Callable[[httpx.Response, Any, Callable[[dict], httpx.Response]], bool]


def texts(answer) -> list[str]:
    return [c.text if hasattr(c, "text") else c.message.content for c in answer.choices]


def counts(usage) -> tuple[int, int, int]:
    """The token counts of a usage (its cached_tokens follow the prefix cache's state)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def differs(parse) -> Check:
    return lambda resp, base, send: texts(parse(resp)) != texts(base)


def same(parse) -> Check:
    return lambda resp, base, send: texts(parse(resp)) == texts(base)


def seeded(parse) -> Check:
    """The same seed draws the same text again; another seed draws another."""
    return lambda resp, base, send: texts(parse(resp)) == texts(parse(send({}))) != \
        texts(parse(send({"seed": 4})))


def stop_at_third_char(parse) -> Check:
    """``stop`` = the baseline's characters 2..4: the answer ends right before them."""
    def check(resp, base, send):
        cut, out = texts(base)[0][2:5], parse(resp)
        return texts(out)[0] == texts(base)[0][:texts(base)[0].find(cut)] and \
            out.choices[0].finish_reason == "stop"
    return check


# field -> (handling, value, check); values go into the base request below.
COMPLETION: dict[str, tuple[str, Any, Check | None]] = {
    "best_of": ("honoured", {"n": 2, "best_of": 2},
                lambda r, b, _: len(completion(r).choices) == 2),
    "echo": ("honoured", True, lambda r, b, _: completion(r).choices[0].text.startswith(PROMPT)),
    "frequency_penalty": ("honoured", 2.0, differs(completion)),
    "logit_bias": ("honoured", {"500": 100},
                   lambda r, b, _: completion(r).choices[0].text == "pre" * 4),
    "logprobs": ("honoured", 2,
                 lambda r, b, _: len(completion(r).choices[0].logprobs.top_logprobs[0]) == 2),
    "max_tokens": ("honoured", 2, lambda r, b, _: completion(r).usage.completion_tokens == 2),
    "model": ("honoured", "no-such-model", lambda r, b, _: error_of(r, 404)["param"] == "model"),
    "n": ("honoured", 3, lambda r, b, _: texts(completion(r)) == texts(b) * 3),
    "presence_penalty": ("honoured", 2.0, differs(completion)),
    "prompt": ("honoured", "A different prompt", differs(completion)),
    "seed": ("honoured", {"seed": 3, "temperature": 2.0}, seeded(completion)),
    "stop": ("honoured", None, stop_at_third_char(completion)),
    "stream": ("honoured", True,
               lambda r, b, _: "".join(c.choices[0].text for c in completion_stream(r)
                                    if c.choices) == texts(b)[0]),
    "stream_options": ("honoured", {"stream": True, "stream_options": {"include_usage": True}},
                       lambda r, b, _: counts(completion_stream(r)[-1].usage) == counts(b.usage)),
    "suffix": ("refused", "and they lived happily ever after.", None),
    "temperature": ("honoured", {"temperature": 2.0, "seed": 5}, differs(completion)),
    "top_p": ("honoured", {"temperature": 2.0, "seed": 5, "top_p": 1e-6}, same(completion)),
    "user": ("noop", "user-1234", same(completion)),
}

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# A function whose only call is {"name": "f", "arguments": {}}: short enough for any model.
CLOSED_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def one_call_to_f(r: httpx.Response, b: Any, _: Any) -> bool:
    choice = chat(r).choices[0]
    calls = choice.message.tool_calls or []
    return choice.finish_reason == "tool_calls" and [(c.function.name, c.function.arguments)
                                                      for c in calls] == [("f", "{}")]
CHAT_FIELDS: dict[str, tuple[str, Any, Check | None]] = {
    "audio": ("refused", {"voice": "alloy", "format": "mp3"}, None),
    "frequency_penalty": ("honoured", 2.0, differs(chat)),
    "function_call": ("refused", "auto", None),
    "functions": ("refused", [{"name": "f", "parameters": {"type": "object"}}], None),
    "logit_bias": ("honoured", {"500": 100},
                   lambda r, b, _: chat(r).choices[0].message.content == "pre" * 4),
    "logprobs": ("honoured", True, lambda r, b, _: len(chat(r).choices[0].logprobs.content) == 4),
    "max_completion_tokens": ("honoured", 2,
                              lambda r, b, _: chat(r).usage.completion_tokens == 2),
    "max_tokens": ("honoured", 2, lambda r, b, _: chat(r).usage.completion_tokens == 2),
    "messages": ("honoured", [{"role": "user", "content": "Something else entirely"}],
                 lambda r, b, _: chat(r).usage.prompt_tokens != b.usage.prompt_tokens),
    "metadata": ("noop", {"project": "parity"}, same(chat)),
    "modalities": ("refused", ["text", "audio"], None),
    "model": ("honoured", "no-such-model", lambda r, b, _: error_of(r, 404)["param"] == "model"),
    "moderation": ("refused", {"model": "omni-moderation-latest"}, None),
    "n": ("honoured", 2, lambda r, b, _: texts(chat(r)) == texts(b) * 2),
    # Forced calls are one call either way; tests/http/test_tool_calls.py shows the effect
    # on parsed answers (one call kept, generation stopped after the first).
    "parallel_tool_calls": ("honoured", {"parallel_tool_calls": False, "tools": [CLOSED_TOOL],
                                         "tool_choice": "required", "max_tokens": 30},
                            one_call_to_f),
    "prediction": ("noop", {"type": "content", "content": "a guess"}, same(chat)),
    "presence_penalty": ("honoured", 2.0, differs(chat)),
    "prompt_cache_key": ("noop", "cache-key", same(chat)),
    "prompt_cache_options": ("noop", {"ttl": "30m"}, same(chat)),
    "prompt_cache_retention": ("noop", "24h", same(chat)),
    # Passed to the chat template, which reads it or not: the tiny model's does not
    # (tests/http/test_reasoning.py shows one that does).
    "reasoning_effort": ("honoured", "low", same(chat)),
    "response_format": ("honoured", {"type": "json_object"},
                        lambda r, b, _: chat(r).choices[0].message.content.startswith("{")),
    "safety_identifier": ("noop", "hashed-user", same(chat)),
    "seed": ("honoured", {"seed": 3, "temperature": 2.0}, seeded(chat)),
    "service_tier": ("noop", "auto", same(chat)),
    "stop": ("honoured", None, stop_at_third_char(chat)),
    "store": ("noop", True, same(chat)),
    "stream": ("honoured", True,
               lambda r, b, _: "".join(c.choices[0].delta.content or "" for c in chat_stream(r)
                                    if c.choices) == texts(b)[0]),
    "stream_options": ("honoured", {"stream": True, "stream_options": {"include_usage": True}},
                       lambda r, b, _: counts(chat_stream(r)[-1].usage) == counts(b.usage)),
    "temperature": ("honoured", {"temperature": 2.0, "seed": 5}, differs(chat)),
    "tool_choice": ("honoured", {"tool_choice": "required", "tools": [CLOSED_TOOL],
                                 "max_tokens": 30}, one_call_to_f),
    "tools": ("honoured", [TOOL],  # offered in the prompt: it grows
              lambda r, b, _: chat(r).usage.prompt_tokens > b.usage.prompt_tokens),
    "top_logprobs": ("honoured", {"logprobs": True, "top_logprobs": 2},
                     lambda r, b, _: len(chat(r).choices[0].logprobs.content[0].top_logprobs) == 2),
    "top_p": ("honoured", {"temperature": 2.0, "seed": 5, "top_p": 1e-6}, same(chat)),
    "user": ("noop", "user-1234", same(chat)),
    "verbosity": ("refused", "low", None),
    "web_search_options": ("refused", {}, None),
}


def openai_fields(module) -> set[str]:
    """The request fields of an ``openai`` create-params module (streaming or not)."""
    names: set[str] = set()
    for cls in (module.CompletionCreateParamsBase, module.CompletionCreateParamsNonStreaming,
                module.CompletionCreateParamsStreaming):
        names |= {name for name in cls.__annotations__ if not name.startswith("_")}
    return names


def test_tables_cover_every_field():
    assert set(COMPLETION) == openai_fields(completion_params)
    assert set(CHAT_FIELDS) == openai_fields(chat_params)


ENDPOINTS = {
    COMPLETIONS: ({"model": "tiny", "prompt": PROMPT}, completion, COMPLETION),
    CHAT: ({"model": "tiny", "messages": MESSAGES}, chat, CHAT_FIELDS),
}
CASES = [(path, field) for path, (_, _, table) in ENDPOINTS.items() for field in table]


@pytest.fixture(scope="module")
def baselines(live_server: LiveServer) -> dict[str, Any]:
    out = {}
    for path, (base, parse, _) in ENDPOINTS.items():
        body = {**base, "max_tokens": 4, "temperature": 0, "logit_bias": NO_EOS}
        out[path] = (body, parse(httpx.post(live_server.base_url + path, json=body, timeout=60)))
    return out


@pytest.mark.parametrize("path,field", CASES, ids=[f"{p.split('/')[-1]}-{f}" for p, f in CASES])
def test_field_is_honoured_or_refused(live_server, baselines, path, field):
    handling, value, check = ENDPOINTS[path][2][field]
    body, baseline = baselines[path]
    if field == "stop":
        text = baseline.choices[0].text if path == COMPLETIONS \
            else baseline.choices[0].message.content
        value = text[2:5]
    if isinstance(value, dict) and field in value:  # the field with the settings it needs
        request = {**body, **value}
    else:
        request = {**body, field: value}
        if field == "logit_bias":
            request[field] = {**NO_EOS, **value}
    def send(changes: dict) -> httpx.Response:
        return httpx.post(live_server.base_url + path, json={**request, **changes}, timeout=60)

    resp = send({})
    if handling == "refused":
        err = error_of(resp, 400)
        assert err["param"] == field, err
        return
    assert check(resp, baseline, send), (handling, resp.text[:500])


@pytest.fixture(scope="module")
def rejecting_server(live_settings) -> LiveServer:
    """The live server's settings with ``server.unknown_fields = "reject"``."""
    settings = live_settings.replace(
        server=live_settings.server.model_copy(update={"unknown_fields": "reject"}))
    with run_server(settings) as server:
        yield server


@pytest.mark.parametrize("path,body,unknown", [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "temprature": 0.0}, "temprature"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 2, "guided_json": {"type": "object"}},
     "guided_json"),
    ("/v1/responses", {"input": "hi", "max_tokens": 2}, "max_tokens"),  # max_output_tokens
])
def test_with_reject_a_field_no_endpoint_knows_is_refused_by_name(rejecting_server, path,
                                                                  body, unknown):
    # OpenAI answers "Unrecognized request argument supplied": a typo, or another server's
    # extension (vLLM's guided_json), is not left silently without effect.
    err = error_of(httpx.post(rejecting_server.base_url + path, json=body, timeout=60))
    assert err["code"] == "unknown_parameter" and err["param"] == unknown
    assert f"unrecognized request argument supplied: {unknown}" in err["message"]


def test_nested_objects_stay_lenient(live_server):
    # An assistant message sent back as the SDK returned it, extra keys and all.
    turn = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": []}
    ok = httpx.post(live_server.base_url + CHAT, timeout=60, json={
        "messages": [*MESSAGES, turn, {"role": "user", "content": "again"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
