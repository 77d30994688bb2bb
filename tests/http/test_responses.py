"""``POST /v1/responses`` (OpenAI's Responses API) through the real ``openai`` client.

On the live tiny-model server: the same generation as chat (greedy text, prompt
tokens), statuses, typed stream events the client's own accumulator reads,
forced function calls, structured output, logprobs and refusals. On the fake
engine (scripted text): calls parsed from free text, their stream, and a
failure after the stream began.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from server.http.app import create_app
from tests.http.test_security import assert_openai_error
from tests.support.fakes import FakeEngine
from tests.support.servers import LiveServer, make_settings

# Arguments with few possible values: a complete call fits in a few tokens whatever the weights.
PICK = {"type": "function", "name": "pick", "description": "Pick an operation.",
        "parameters": {"type": "object", "properties": {"op": {"enum": ["add", "sub"]},
                                                        "exact": {"type": "boolean"}},
                       "required": ["op", "exact"], "additionalProperties": False}}
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["tag", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0)


def test_same_generation_as_chat(client: openai.OpenAI, live_server: LiveServer):
    """instructions + input is chat's system + user conversation: same tokens, same text."""
    out = client.responses.create(model="default", instructions="Be brief.",
                                  input=[{"role": "user", "content": [
                                      {"type": "input_text", "text": "Name a color."}]}],
                                  max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model="default", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a color."}])
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.input_tokens + 6
    # Ran out of max_output_tokens: incomplete, as OpenAI says it.
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output[0].status == "incomplete"
    assert out.id.startswith("resp_") and out.model == live_server.engine.model_name
    live_server.wait_idle()


def test_stream_events_build_the_same_response(client: openai.OpenAI):
    events = list(client.responses.create(model="default", input="Count to five",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text
    whole = client.responses.create(model="default", input="Count to five",
                                    max_output_tokens=8, temperature=0)
    assert whole.output_text == deltas and final.usage.output_tokens == 8


def test_forced_call_streams_to_a_completed_response(client: openai.OpenAI):
    """The client's own stream helper accumulates the events into the final response."""
    with client.responses.stream(model="default", input="Add or subtract?", tools=[PICK],
                                 tool_choice={"type": "function", "name": "pick"},
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.completed" and final.status == "completed"
    (call,) = final.output  # only the call: no empty message item
    assert call.type == "function_call" and call.name == "pick"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PICK["parameters"])
    # The call streams as it is written: its item opens first, then several argument
    # pieces that join to the final arguments, all under the final item's id.
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (added,) = [e for e in events if e.type == "response.output_item.added"]
    assert len(deltas) > 1 and kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta")
    assert "".join(d.delta for d in deltas) == done.arguments == call.arguments
    assert {d.item_id for d in deltas} == {done.item_id, added.item.id} == {call.id}
    assert added.item.call_id == call.call_id and added.item.status == "in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_forced_call_cut_by_max_output_tokens_streams_what_was_written(
        client: openai.OpenAI):
    # (The SDK's stream helper wants response.completed; the raw stream ends incomplete.)
    events = list(client.responses.create(
        model="default", input="Add or subtract?", tools=[PICK], stream=True,
        tool_choice={"type": "function", "name": "pick"}, max_output_tokens=16,
        temperature=0))
    final = events[-1].response
    assert final.status == "incomplete" and events[-1].type == "response.incomplete"
    (call,) = final.output
    assert call.status == "incomplete"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments and call.arguments.startswith("{")


def test_tool_history_renders_like_chat(client: openai.OpenAI, live_server: LiveServer):
    """function_call / function_call_output items are chat's tool_calls / tool messages."""
    args = json.dumps({"city": "Oslo"})
    out = client.responses.create(model="default", tools=[WEATHER], max_output_tokens=2, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    chat_tools = [{"type": "function",
                   "function": {"name": WEATHER["name"], "parameters": WEATHER["parameters"]}}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    counted = httpx.post(live_server.base_url + "/tokenize",
                         json={"tools": chat_tools, "messages": messages}).json()
    assert out.usage.input_tokens == counted["count"]


def test_json_schema_format(client: openai.OpenAI):
    out = client.responses.create(model="default", input="Reply in JSON.", max_output_tokens=40,
                                  text={"format": {"type": "json_schema", "name": "probe",
                                                   "schema": SCHEMA, "strict": True}})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text.format.type == "json_schema"


def test_logprobs_when_included(client: openai.OpenAI):
    # Greedy, so no end token comes before the third.
    out = client.responses.create(model="default", input="x", max_output_tokens=3,
                                  temperature=0, include=["message.output_text.logprobs"],
                                  top_logprobs=2)
    entries = out.output[0].content[0].logprobs
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)
    assert out.top_logprobs == 2
    assert "".join(e.token for e in entries) == out.output_text
    plain = client.responses.create(model="default", input="x", max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("fields,status,param", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"background": True}, 400, "background"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"include": ["file_search_call.results", "bogus"]}, 400, "include[1]"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "tools[0].name"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [PICK]}, 400,
     "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input[0].call_id"),
    ({"input": []}, 400, "input"),
    ({"max_output_tokens": 10**7}, 400, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     400, "text.format"),
    ({"stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    ({"text": {"format": "text"}}, 400, "text.format"),
    ({"moderation": {"model": "omni-moderation-latest"}}, 400, "moderation"),
    ({"context_management": [{"type": "compaction"}]}, 400, "context_management"),
    ({"image": {"context_compression": "enabled"}}, 400, "image"),
    ({"access_programs": {"cyber": "standard"}}, 400, "access_programs"),
    ({"background_options": {"completion_window": "2h"}}, 400, "background_options"),
    ({"temperature": 3}, 400, "temperature"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_refusals_name_the_responses_field(live_server: LiveServer, fields, status, param):
    body = {"model": "default", "input": "x", "max_output_tokens": 4, **fields}
    resp = httpx.post(live_server.base_url + "/v1/responses", json=body, timeout=30)
    err = assert_openai_error(resp, status)
    assert err["param"] == param, err
    if param == "max_output_tokens":
        assert err["message"].startswith("max_output_tokens=10000000 is over")


def test_every_field_of_the_openai_request_is_declared():
    """Each is honoured, a hint without effect, or refused: none is silently dropped.

    A new ``openai`` release with a new Responses field fails here until it is handled.
    """
    import typing

    import openai.types.responses.response_create_params as params

    from server.http.schemas.responses import ResponsesRequest

    fields = set()
    for cls in (params.ResponseCreateParamsBase, params.ResponseCreateParamsStreaming):
        fields |= set(typing.get_type_hints(cls))
    assert fields <= set(ResponsesRequest.model_fields)


def test_messages_speak_of_the_responses_shapes(live_server: LiveServer):
    url = live_server.base_url + "/v1/responses"
    bad_choice = httpx.post(url, json={"input": "x", "tools": [PICK],
                                       "tool_choice": {"type": "tool"}}).json()["error"]
    assert '{"type": "function", "name": ...}' in bad_choice["message"]
    bad_name = httpx.post(url, json={"input": "x", "tools": [
        {"type": "function", "name": "a b"}]}).json()["error"]
    assert bad_name["param"] == "tools[0].name" and "tools[0].name must" in bad_name["message"]
    bad_schema = httpx.post(url, json={"input": "x", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": 5}}}).json()["error"]
    assert "text.format.schema must" in bad_schema["message"], bad_schema


def test_a_tool_with_null_parameters_is_a_function_without_any(client: openai.OpenAI):
    """SDKs send ``parameters: null`` for a function that takes no arguments."""
    now = {"type": "function", "name": "now", "parameters": None, "description": None}
    out = client.responses.create(model="default", input="Time?", tools=[now],
                                  tool_choice="required", max_output_tokens=20)
    assert out.output[-1].type == "function_call" and out.output[-1].name == "now"
    assert json.loads(out.output[-1].arguments) == {}  # no parameters: no arguments
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Time?"}], max_tokens=20,
        tools=[{"type": "function", "function": {"name": "now", "parameters": None}}],
        tool_choice="required")
    assert chat.choices[0].message.tool_calls[0].function.name == "now"


# -- scripted answers (fake engine) ---------------------------------------------------------

TWO_CALLS = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '</tool_call>\n<tool_call>{"name": "pick", "arguments": {"op": "add", "exact": '
             'true}}</tool_call>')


@pytest.fixture()
def fake():
    engine = FakeEngine()
    with TestClient(create_app(make_settings(), engine)) as client:
        yield engine, client


def test_calls_in_free_text_become_items(fake):
    engine, client = fake
    body = {"input": "SCRIPT:" + TWO_CALLS, "tools": [WEATHER, PICK]}
    out = openai.types.responses.Response.model_validate(
        client.post("/v1/responses", json=body).json())
    assert out.status == "completed"
    assert [o.type for o in out.output] == ["message", "function_call", "function_call"]
    assert out.output_text == "Let me check."
    assert json.loads(out.output[1].arguments) == {"city": "Paris"}
    assert [t["function"]["name"] for t in engine.submitted[-1].prompt.tools] == \
        ["get_weather", "pick"]
    single = client.post("/v1/responses", json={**body, "parallel_tool_calls": False}).json()
    assert [o["type"] for o in single["output"]] == ["message", "function_call"]


def _events(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200 and resp.headers["content-type"].startswith(
        "text/event-stream")
    blocks = [b for b in resp.text.split("\n\n") if b]
    events = []
    for block in blocks:
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[6:])
        assert event["type"] == kind[7:]
        events.append(event)
    return events


def test_calls_before_a_cut_still_make_the_response_incomplete(fake):
    """max_output_tokens ran out after one call: a later one may be lost, so incomplete."""
    _, client = fake
    body = {"input": "SCRIPTCUT:" + TWO_CALLS[:-40], "tools": [WEATHER, PICK]}
    out = client.post("/v1/responses", json=body).json()
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    # The second call, cut inside its arguments, is the call so far (not text).
    assert [o["type"] for o in out["output"]] == ["message", "function_call", "function_call"]
    assert [o.get("status") for o in out["output"][1:]] == ["completed", "incomplete"]
    assert "<tool_call>" not in out["output"][0]["content"][0]["text"]
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "SCRIPTCUT:" + TWO_CALLS[:-40]}],
        "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in (WEATHER, PICK)]}).json()
    assert chat["choices"][0]["finish_reason"] == "length"
    whole, cut = chat["choices"][0]["message"]["tool_calls"]
    assert whole["function"]["name"] == "get_weather" and cut["function"]["name"] == "pick"
    assert cut["function"]["arguments"] == "{"  # the arguments so far, as OpenAI cuts them


def test_streamed_calls_hold_back_their_text(fake):
    _, client = fake
    body = {"input": "SCRIPT:" + TWO_CALLS, "tools": [WEATHER, PICK], "stream": True}
    events = _events(client.post("/v1/responses", json=body))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas.strip() == "Let me check."  # no tag or call JSON ever reached the text
    final = events[-1]
    assert final["type"] == "response.completed"
    assert final["response"]["output"][0]["content"][0]["text"] == deltas
    assert [o["type"] for o in final["response"]["output"]] == \
        ["message", "function_call", "function_call"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2]
    args = [e["arguments"] for e in events
            if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}, {"op": "add", "exact": True}]


def test_failure_after_the_stream_began(fake):
    _, client = fake
    events = _events(client.post("/v1/responses", json={"input": "FAIL", "stream": True}))
    assert events[-1]["type"] == "response.failed"
    error = events[-1]["response"]["error"]
    assert error["code"] == "server_error" and "injected" in error["message"]
    assert any(e["type"] == "response.output_text.delta" for e in events)


@pytest.mark.slow
def test_truncation_auto_drops_the_oldest_input_items_that_do_not_fit(client: openai.OpenAI):
    # The tiny model's context is 4,096 tokens: two ~3,000-token items cannot both stay.
    long = "word " * 3000
    items = [{"role": "user", "content": long}, {"role": "assistant", "content": long},
             {"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="context"):
        client.responses.create(model="default", input=items, max_output_tokens=4)
    out = client.responses.create(model="default", input=items, max_output_tokens=4,
                                  instructions="Be brief.", truncation="auto", temperature=0)
    assert out.truncation == "auto" and out.usage.output_tokens == 4
    # The first item went; instructions, the assistant's turn and the last item stayed.
    alone = client.responses.create(model="default", input=items[1:], max_output_tokens=4,
                                    instructions="Be brief.", temperature=0)
    assert out.usage.input_tokens == alone.usage.input_tokens
    assert out.output_text == alone.output_text


def test_a_completed_response_says_when_and_echoes_the_request_hints(client: openai.OpenAI):
    out = client.responses.create(model="default", input="Pick.", tools=[PICK],
                                  tool_choice="required", max_output_tokens=40, user="u-1",
                                  prompt_cache_key="k-1", temperature=0)
    assert out.status == "completed" and out.completed_at >= out.created_at
    assert (out.user, out.prompt_cache_key) == ("u-1", "k-1")
    cut = client.responses.create(model="default", input="Hi", max_output_tokens=2,
                                  temperature=0)
    assert cut.status == "incomplete" and cut.completed_at is None


def test_allowed_tools_narrow_a_required_call(client: openai.OpenAI):
    out = client.responses.create(
        model="default", input="Pick.", tools=[WEATHER, PICK], max_output_tokens=40,
        temperature=0, tool_choice={"type": "allowed_tools", "mode": "required",
                                    "tools": [{"type": "function", "name": "pick"}]})
    (call,) = out.output
    assert call.type == "function_call" and call.name == "pick" and out.status == "completed"
    assert out.tool_choice.type == "allowed_tools"


def test_a_replayed_refusal_part_is_the_assistants_words(client: openai.OpenAI,
                                                          live_server: LiveServer):
    # A client replays earlier output items as input; a refusal part is its words, not a 400.
    out = client.responses.create(model="default", max_output_tokens=2, input=[
        {"role": "user", "content": "Do the bad thing."},
        {"type": "message", "role": "assistant",
         "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": "Fine."}])
    messages = [{"role": "user", "content": "Do the bad thing."},
                {"role": "assistant", "content": "I can't help with that."},
                {"role": "user", "content": "Fine."}]
    counted = httpx.post(live_server.base_url + "/tokenize", json={"messages": messages}).json()
    assert out.usage.input_tokens == counted["count"]


@pytest.mark.parametrize("fields", [{"input": "a\ud800"},
                                    {"input": "hi", "instructions": "\ud800"}])
def test_a_lone_surrogate_is_named_in_responses_terms(live_server: LiveServer, fields):
    resp = httpx.post(live_server.base_url + "/v1/responses", content=json.dumps(fields))
    error = assert_openai_error(resp, 400)
    assert error["param"] == "input" and "messages" not in error["message"]
    assert "the input or instructions is not valid Unicode" in error["message"]
